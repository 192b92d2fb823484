"""``omnistage serve`` arguments and entry point.

``add_serve_args(parser)`` is what the top-level CLI (``omnistage/entrypoints/cli.py``)
imports lazily for its ``serve`` subcommand; ``serve_main(args)`` runs the
server until interrupted. ``main()`` does both for
``python -m omnistage.entrypoints.openai.api_server``.
"""

from __future__ import annotations

import argparse
import errno
import logging
import socket
import sys
from typing import Any, TextIO

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The engine's flags (``EngineArgs``, the model also positional, as in
    ``vllm serve MODEL``), then the server's."""
    from omnistage.engine.arg_utils import EngineArgs

    EngineArgs.add_cli_args(parser, model_positional=True)
    server = parser.add_argument_group("server")
    server.add_argument("--host", default=DEFAULT_HOST, help=f"(default: {DEFAULT_HOST})")
    server.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"0 picks a free one (default: {DEFAULT_PORT})")
    server.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    server.add_argument(
        "--served-model-name", nargs="+", default=None, metavar="NAME",
        help="model name(s) clients send; the first is reported in responses (default: --model)",
    )
    server.add_argument(
        "--allowed-local-media-path", default=None, metavar="DIR",
        help="allow file:// image URLs that resolve inside DIR (off by default)",
    )
    server.add_argument(
        "--trust-request-chat-template", action="store_true",
        help="let a request bring its own chat template (chat_template_kwargs.chat_template); off by default",
    )
    server.add_argument("--max-request-body-bytes", type=int, default=16 * 1024 * 1024, help="(default: 16 MiB)")
    server.add_argument("--max-image-pixels", type=int, default=4096 * 4096, help="(default: 4096x4096)")
    server.add_argument("--max-audio-seconds", type=float, default=600.0, help="(default: 600)")
    server.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    server.add_argument(
        "--stats-log-interval", type=float, default=10.0, metavar="SECONDS",
        help="log an engine-stats line this often while busy; 0 turns it off",
    )

    omni = parser.add_argument_group("omni checkpoints (speech)")
    omni.add_argument(
        "--talker-max-tokens", type=int, default=None,
        help="the most codec tokens the talker generates per answer (default 4096)",
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
        stats_log_interval_s=_stats_log_interval(args),
        trust_request_chat_template=getattr(args, "trust_request_chat_template", False),
    )


def _stats_log_interval(args: argparse.Namespace) -> float:
    """--stats-log-interval, or 0 (no stats line) with vLLM's --disable-log-stats."""
    return 0.0 if getattr(args, "disable_log_stats", False) else getattr(args, "stats_log_interval", 10.0)


def serve_main(args: argparse.Namespace, err: TextIO | None = None) -> None:
    """Take the port, load the model, then serve until interrupted.

    The port is bound first, so a busy one fails in a second rather than after
    the model loaded; a model that does not load fails (``ValueError``) before
    uvicorn starts. The bound socket is the one uvicorn serves on."""
    import uvicorn

    from omnistage.engine.arg_utils import EngineArgs
    from omnistage.entrypoints.loading import core_engine, load_llm
    from omnistage.entrypoints.openai.api_server import build_app

    err = err or sys.stderr
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine_kwargs = EngineArgs.cli_kwargs(args)
    options = server_options_from(args)
    sock = listening_socket(args.host, args.port)
    try:
        omni = {"talker_params": options.talker_params} if options.talker_params else None
        _, engine = load_llm(engine_kwargs, err, omni)
        loaded = [engine]  # the first build is the engine just loaded; a rebuild loads anew

        def engine_factory() -> Any:
            return loaded.pop() if loaded else load_llm(engine_kwargs, err, omni)[1]

        app = build_app(core_engine(engine).args, options, engine_factory=engine_factory)
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        err.write(f"omnistage serve: listening on http://{shown}:{port} (OpenAI API under /v1; Ctrl-C stops)\n")
        err.flush()
        config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5)
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port``, or ``ValueError`` saying why not
    (the port taken, the address not this machine's)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r}: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a port in TIME_WAIT is free
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        hint = "; is another server running there? pick another with --port" if e.errno == errno.EADDRINUSE else ""
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}{hint}") from None
    return sock


def make_arg_parser() -> argparse.ArgumentParser:
    return add_serve_args(argparse.ArgumentParser(prog="omnistage serve", description="OpenAI-compatible server"))


def main(argv: list[str] | None = None) -> None:
    args = make_arg_parser().parse_args(argv)
    try:
        serve_main(args)
    except (ValueError, OSError) as e:  # one line, as ``omnistage serve`` gives
        raise SystemExit(f"omnistage serve: error: {e}") from None
