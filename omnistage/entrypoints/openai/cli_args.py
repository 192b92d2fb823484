"""``omnistage serve`` arguments and entry point.

``add_serve_args(parser)`` is what the top-level CLI (``omnistage/entrypoints/cli.py``)
imports lazily for its ``serve`` subcommand; ``serve_main(args)`` runs the
server until interrupted. ``main()`` does both for
``python -m omnistage.entrypoints.openai.api_server``.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    server = parser.add_argument_group("server")
    server.add_argument("--model", default=None, help="checkpoint folder or GGUF file (default: the embedded SmolLM2-135M-Instruct)")
    server.add_argument("--host", default=DEFAULT_HOST)
    server.add_argument("--port", type=int, default=DEFAULT_PORT)
    server.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    server.add_argument(
        "--served-model-name", nargs="+", default=None, metavar="NAME",
        help="model name(s) clients send; the first is reported in responses (default: --model)",
    )
    server.add_argument(
        "--allowed-local-media-path", default=None, metavar="DIR",
        help="allow file:// image URLs that resolve inside DIR (off by default)",
    )
    server.add_argument("--max-request-body-bytes", type=int, default=16 * 1024 * 1024)
    server.add_argument("--max-image-pixels", type=int, default=4096 * 4096)
    server.add_argument("--max-audio-seconds", type=float, default=600.0)
    server.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    server.add_argument(
        "--stats-log-interval", type=float, default=10.0, metavar="SECONDS",
        help="log an engine-stats line this often while busy; 0 turns it off",
    )

    engine = parser.add_argument_group("engine")
    engine.add_argument("--dtype", default="float32")
    engine.add_argument("--device", default="cpu")
    engine.add_argument("--block-size", type=int, default=16)
    engine.add_argument("--num-kv-blocks", type=int, default=None)
    engine.add_argument("--max-num-batched-tokens", type=int, default=2048)
    engine.add_argument("--max-num-seqs", type=int, default=64)
    engine.add_argument("--max-model-len", type=int, default=None)
    engine.add_argument("--no-prefix-caching", action="store_true", help="disable the KV prefix cache")
    engine.add_argument("--seed", type=int, default=0)
    engine.add_argument(
        "--talker-max-tokens", type=int, default=None,
        help="omni checkpoints: the most codec tokens the talker generates per answer (default 4096)",
    )
    return parser


def server_options_from(args: argparse.Namespace) -> Any:
    from omnistage.entrypoints.openai.api_server import ServerOptions

    return ServerOptions(
        served_model_names=args.served_model_name,
        api_key=args.api_key,
        allowed_local_media_path=args.allowed_local_media_path,
        max_request_body_bytes=args.max_request_body_bytes,
        max_image_pixels=args.max_image_pixels,
        max_audio_seconds=args.max_audio_seconds,
        talker_params={"max_tokens": args.talker_max_tokens} if getattr(args, "talker_max_tokens", None) else None,
        stats_log_interval_s=getattr(args, "stats_log_interval", 10.0),
    )


def serve_main(args: argparse.Namespace) -> None:
    """Build the app and serve it with uvicorn until interrupted."""
    import uvicorn

    from omnistage.engine.arg_utils import EngineArgs
    from omnistage.entrypoints.openai.api_server import build_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build_app(EngineArgs.from_cli_args(args), server_options_from(args))
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)


def make_arg_parser() -> argparse.ArgumentParser:
    return add_serve_args(argparse.ArgumentParser(prog="omnistage serve", description="OpenAI-compatible server"))


def main(argv: list[str] | None = None) -> None:
    serve_main(make_arg_parser().parse_args(argv))
