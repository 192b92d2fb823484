"""The ``omnistage`` command: ``generate``, ``chat`` and (when installed) ``serve``."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TextIO

from omnistage.sampling_params import SamplingParams


def _add_common_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    # Engine flags default to None: EngineArgs holds the defaults (EngineArgs.from_cli_args).
    g = p.add_argument_group("model and engine (defaults: EngineArgs)")
    g.add_argument("--model", help="checkpoint folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    g.add_argument("--device", help="cpu (default), cuda, ...")
    g.add_argument("--dtype", help="float32 (default), bfloat16, float16")
    g.add_argument("--block-size", type=int)
    g.add_argument("--max-num-batched-tokens", type=int)
    g.add_argument("--max-num-seqs", type=int)
    g.add_argument("--max-model-len", type=int)
    g.add_argument("--num-kv-blocks", type=int, help="KV pool size (default: sized from a memory budget)")
    g.add_argument("--no-prefix-caching", action="store_true", help="disable the KV prefix cache")
    s = p.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=max_tokens)
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--seed", type=int, default=None, help="seeds sampling (and the engine)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omnistage", description="omnistage inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete prompts, print one JSON line per prompt")
    gen.add_argument("prompts", nargs="*", help="prompt strings")
    gen.add_argument("--file", help="prompts file: one per line, or JSON lines with a 'prompt' (and optional 'id')")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn in the chat template")
    gen.add_argument("--audio-dir", default=".", help="omni checkpoints: where the spoken answers go, as <id>.wav")
    gen.add_argument("--speaker", default=None, help="omni checkpoints: the voice (default: the checkpoint's)")
    gen.add_argument("--no-audio", action="store_true", help="omni checkpoints: text only, skip the talker")
    gen.add_argument("--talker-max-tokens", type=int, default=None, help="omni checkpoints: cap on codec tokens")
    _add_common_args(gen, max_tokens=64)
    chat = sub.add_parser("chat", help="multi-turn chat; reads stdin line by line when it is not a terminal")
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument("--stats", action="store_true", help="print prompt/cached tokens and TTFT per turn to stderr")
    _add_common_args(chat, max_tokens=256)
    serve_args = _serve_hooks()
    if serve_args is not None:
        serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
        serve_args[0](serve)
    return parser


def _serve_hooks() -> tuple[Any, Any] | None:
    """``(add_serve_args, serve_main)`` if the OpenAI server package is present."""
    if importlib.util.find_spec("omnistage.entrypoints.openai.cli_args") is None:
        return None
    from omnistage.entrypoints.openai.cli_args import add_serve_args, serve_main

    return add_serve_args, serve_main


def _engine(args: argparse.Namespace) -> Any:
    from omnistage.engine.arg_utils import EngineArgs
    from omnistage.engine.stage_engine import LLMEngine

    return LLMEngine(EngineArgs.from_cli_args(args))  # --seed seeds the engine too


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed, max_tokens=args.max_tokens
    )


def _read_prompts(args: argparse.Namespace) -> list[tuple[str, str]]:
    """``(id, prompt)`` pairs from the arguments, then the file."""
    items = [(str(i), p) for i, p in enumerate(args.prompts)]
    if args.file:
        with open(args.file, encoding="utf-8") as f:
            lines = [line.rstrip("\n") for line in f if line.strip()]
        for line in lines:
            rid, prompt = str(len(items)), line
            if line.lstrip().startswith("{"):
                obj = json.loads(line)
                if "prompt" not in obj:
                    raise SystemExit(f"omnistage generate: JSON line without a 'prompt' key: {line[:80]}")
                rid, prompt = str(obj.get("id", rid)), obj["prompt"]
            items.append((rid, prompt))
    return items


def run_generate(args: argparse.Namespace, out: TextIO) -> int:
    items = _read_prompts(args)
    if not items:
        raise SystemExit("omnistage generate: no prompts; pass them as arguments or with --file")
    params = _sampling_params(args)  # fail on bad flags before loading the model
    from omnistage.models.qwen2_5_omni import is_omni_checkpoint

    if args.model is not None and is_omni_checkpoint(args.model):
        return _run_generate_omni(args, items, params, out)
    engine = _engine(args)
    errors: dict[str, str] = {}
    for i, (_, prompt) in enumerate(items):
        request = engine.encode_chat([{"role": "user", "content": prompt}]) if args.chat else prompt
        try:
            engine.add_request(str(i), request, params)
        except ValueError as e:  # reported on its own line; the other prompts still run
            errors[str(i)] = str(e)
    results: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                results[o.request_id] = o
    for i, (rid, prompt) in enumerate(items):
        if str(i) in errors:
            out.write(json.dumps({"id": rid, "prompt": prompt, "error": errors[str(i)]}, ensure_ascii=False) + "\n")
            continue
        o = results[str(i)]
        c = o.outputs[0]
        row = {
            "id": rid,
            "prompt": prompt,
            "text": c.text,
            "token_ids": c.token_ids,
            "finish_reason": c.finish_reason,
            "num_cached_tokens": o.num_cached_tokens,
        }
        out.write(json.dumps(row, ensure_ascii=False) + "\n")
    out.flush()
    return 0


def _run_generate_omni(args: argparse.Namespace, items: list[tuple[str, str]], params: SamplingParams, out: TextIO) -> int:
    """Text and speech from an omni checkpoint: one JSON line per prompt, one WAV file per answer."""
    from omnistage.engine.arg_utils import EngineArgs
    from omnistage.entrypoints.omni_llm import OmniLLM
    from omnistage.multimodal.media import write_wav

    engine_args = {k: v for k, v in vars(EngineArgs.from_cli_args(args)).items() if k != "model"}
    talker = {"max_tokens": args.talker_max_tokens} if args.talker_max_tokens else None
    llm = OmniLLM(args.model, talker_params=talker, **engine_args)
    prompts = [[{"role": "user", "content": p}] for _, p in items] if args.chat else [p for _, p in items]
    run = llm.chat if args.chat else llm.generate
    outputs = run(prompts, params, return_audio=not args.no_audio, speaker=args.speaker)
    audio_dir = Path(args.audio_dir)
    audio_dir.mkdir(parents=True, exist_ok=True)
    for (rid, prompt), o in zip(items, outputs):
        c = o.outputs[0]
        row = {"id": rid, "prompt": prompt, "text": c.text, "token_ids": c.token_ids,
               "finish_reason": c.finish_reason, "num_cached_tokens": o.num_cached_tokens}
        if o.audio is not None:
            row["audio_path"] = str(write_wav(audio_dir / f"{rid}.wav", o.audio, o.sample_rate))
            row["sample_rate"] = o.sample_rate
        out.write(json.dumps(row, ensure_ascii=False) + "\n")
    out.flush()
    return 0


def stream_answer(engine: Any, request_id: str, prompt: dict, params: SamplingParams, out: TextIO) -> Any:
    """Run one request, writing its text as it grows; return the final output."""
    engine.add_request(request_id, prompt, params)
    shown = 0
    final = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            text = o.outputs[0].text
            out.write(text[shown:])
            out.flush()
            shown = len(text)
            if o.finished:
                final = o
    out.write("\n")
    out.flush()
    return final


def run_chat(args: argparse.Namespace, stdin: TextIO, out: TextIO, err: TextIO) -> int:
    params = _sampling_params(args)
    engine = _engine(args)
    interactive = stdin.isatty()
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    if interactive:
        err.write("omnistage chat: type a message, an empty line or Ctrl-D to quit\n")
    for turn, line in enumerate(_user_lines(stdin, interactive, err)):
        messages.append({"role": "user", "content": line})
        if interactive:
            out.write("assistant> ")
        final = stream_answer(engine, f"turn-{turn}", engine.encode_chat(messages), params, out)
        messages.append({"role": "assistant", "content": final.outputs[0].text})
        if args.stats:
            ttft = final.metrics.time_to_first_token or 0.0
            err.write(
                f"[turn {turn + 1}: {final.num_cached_tokens}/{len(final.prompt_token_ids)} prompt tokens "
                f"cached, TTFT {ttft * 1000:.0f} ms]\n"
            )
    return 0


def _user_lines(stdin: TextIO, interactive: bool, err: TextIO) -> Iterable[str]:
    while True:
        if interactive:
            err.write("user> ")
            err.flush()
        line = stdin.readline()
        if not line:
            return
        line = line.strip()
        if not line:
            if interactive:
                return
            continue
        yield line


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return run_generate(args, sys.stdout)
        if args.command == "chat":
            return run_chat(args, sys.stdin, sys.stdout, sys.stderr)
    except ValueError as e:  # bad flags, model path or parameters: one line, not a traceback
        print(f"omnistage {args.command}: error: {e}", file=sys.stderr)
        return 2
    hooks = _serve_hooks()
    assert hooks is not None and args.command == "serve"
    hooks[1](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
