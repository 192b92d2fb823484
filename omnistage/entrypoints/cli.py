"""The ``omnistage`` command: ``generate``, ``chat`` and (when installed) ``serve``.

The engine flags of every subcommand come from ``EngineArgs.add_cli_args``;
this module adds the sampling flags and each subcommand's own. Errors the
user can fix (a bad flag value, a missing file, a model that will not load)
end the command with one line on stderr and exit status 2, not a traceback.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import re
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

from omnistage import __version__
from omnistage.engine.arg_utils import EngineArgs
from omnistage.sampling_params import SamplingParams

CHAT_HELP = """commands:
  /reset  start a new conversation (the system prompt stays)
  /help   this list
  /exit   quit (so do Ctrl-D and Ctrl-C at the prompt)
Ctrl-C while an answer streams stops that answer."""


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    s = p.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=max_tokens, help=f"tokens per answer (default: {max_tokens})")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    s.add_argument("--top-p", type=float, default=1.0, help="(default: 1.0)")
    s.add_argument("--top-k", type=int, default=0, help="0 = all tokens (default: 0)")
    s.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omnistage", description="omnistage inference engine")
    parser.add_argument("--version", action="version", version=f"omnistage {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{generate,chat,serve}")
    gen = sub.add_parser("generate", help="complete prompts, print one JSON line per prompt")
    gen.add_argument("prompts", nargs="*", help="prompt strings")
    gen.add_argument("--file", help="prompts file: one per line, or JSON lines with a 'prompt' (and optional 'id')")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn in the chat template")
    omni = gen.add_argument_group("omni checkpoints (speech)")
    omni.add_argument("--audio-dir", default=None, help="speak the answers into DIR/<id>.wav (default: no audio)")
    omni.add_argument("--speaker", default=None, help="the voice (default: the checkpoint's)")
    omni.add_argument("--talker-max-tokens", type=int, default=None, help="cap on codec tokens per answer")
    _add_sampling_args(gen, max_tokens=64)
    EngineArgs.add_cli_args(gen)
    chat = sub.add_parser("chat", help="multi-turn chat; reads stdin line by line when it is not a terminal")
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument("--stats", action="store_true", help="print prompt/cached tokens and TTFT per turn to stderr")
    _add_sampling_args(chat, max_tokens=256)
    EngineArgs.add_cli_args(chat)
    for p in (gen, chat):
        p.set_defaults(subparser=p)
    serve_args = _serve_hooks()
    if serve_args is not None:
        serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
        serve_args[0](serve)
        serve.set_defaults(subparser=serve)
    return parser


def _serve_hooks() -> tuple[Any, Any] | None:
    """``(add_serve_args, serve_main)`` if the OpenAI server package is present."""
    if importlib.util.find_spec("omnistage.entrypoints.openai.cli_args") is None:
        return None
    from omnistage.entrypoints.openai.cli_args import add_serve_args, serve_main

    return add_serve_args, serve_main


def _sampling_params(args: argparse.Namespace, index: int = 0) -> SamplingParams:
    """Request ``index``'s parameters. Each request is seeded from --seed and its index, so a
    run repeats itself even where the engine's shared generator would not: with speculation,
    how many numbers a step draws depends on which drafts it verifies."""
    return SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos, seed=args.seed + index,
    )  # fmt: skip


def _load(args: argparse.Namespace, err: TextIO) -> tuple[Any, Any]:
    from omnistage.entrypoints.loading import load_llm

    cap = getattr(args, "talker_max_tokens", None)
    return load_llm(EngineArgs.cli_kwargs(args), err, {"talker_params": {"max_tokens": cap}} if cap else None)


# -- generate ----------------------------------------------------------------------


def _read_prompts(args: argparse.Namespace) -> list[tuple[str, Any]]:
    """``(id, prompt)`` pairs from the arguments, then the file; a bad file raises
    ``ValueError`` naming it (and the line)."""
    items: list[tuple[str, Any]] = [(str(i), p) for i, p in enumerate(args.prompts)]
    if not args.file:
        return items
    path = Path(args.file)
    if not path.is_file():
        raise ValueError(f"--file {args.file!r}: no such file")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise ValueError(f"--file {args.file!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        rid, prompt = str(len(items)), line
        if line.lstrip().startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{args.file}:{number}: not valid JSON ({e.msg}, column {e.colno})") from None
            if not isinstance(obj, dict) or "prompt" not in obj:
                raise ValueError(f"{args.file}:{number}: a JSON line needs a 'prompt' key")
            rid, prompt = str(obj.get("id", rid)), obj["prompt"]
        items.append((rid, prompt))
    return items


def run_generate(args: argparse.Namespace, out: TextIO, err: TextIO = sys.stderr) -> int:
    items = _read_prompts(args)
    if not items:
        raise ValueError("no prompts; pass them as arguments or with --file")
    _sampling_params(args)  # fail on bad flags before loading the model
    _, engine = _load(args, err)
    from omnistage.entrypoints.loading import can_speak

    speak = args.audio_dir is not None and can_speak(engine)
    if args.audio_dir is not None and not speak:
        err.write("omnistage generate: warning: this model cannot speak; --audio-dir is ignored\n")
    if args.speaker is not None and not speak:
        err.write("omnistage generate: warning: --speaker needs --audio-dir and a model that speaks; ignored\n")
    # An engine that speaks is told whether to; one that cannot is asked nothing.
    audio = {"return_audio": speak, "speaker": args.speaker if speak else None} if can_speak(engine) else {}
    errors: dict[str, str] = {}
    for i, (_, prompt) in enumerate(items):
        try:  # a bad prompt is reported on its own line; the other prompts still run
            request = engine.encode_chat([{"role": "user", "content": prompt}]) if args.chat else prompt
            engine.add_request(str(i), request, _sampling_params(args, i), **audio)
        except ValueError as e:
            errors[str(i)] = str(e)
    results: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                results[o.request_id] = o
    audio_dir = Path(args.audio_dir) if speak else None
    written = 0
    for i, (rid, prompt) in enumerate(items):
        if str(i) in errors:
            out.write(json.dumps({"id": rid, "prompt": prompt, "error": errors[str(i)]}, ensure_ascii=False) + "\n")
            continue
        o = results[str(i)]
        c = o.outputs[0]
        row = {"id": rid, "prompt": prompt, "text": c.text, "token_ids": c.token_ids,
               "finish_reason": c.finish_reason, "num_cached_tokens": o.num_cached_tokens}  # fmt: skip
        if o.error is not None:  # it failed in the engine (a failed step): what it had so far, and why
            row["error"] = o.error
        if audio_dir is not None and o.audio is not None:
            from omnistage.multimodal.media import write_wav

            audio_dir.mkdir(parents=True, exist_ok=True)
            row["audio_path"] = str(write_wav(audio_dir / f"{_file_stem(rid, i)}.wav", o.audio, o.sample_rate))
            row["sample_rate"] = o.sample_rate
            written += 1
        out.write(json.dumps(row, ensure_ascii=False) + "\n")
    out.flush()
    if audio_dir is not None:
        err.write(f"omnistage generate: wrote {written} spoken answer(s) to {audio_dir}/ as <id>.wav\n")
    return 0


def _file_stem(rid: str, index: int) -> str:
    """A request id as a file name, or the prompt's index when the id would leave the folder."""
    return rid if re.fullmatch(r"[\w.-]+", rid) and rid not in (".", "..") else str(index)


# -- chat --------------------------------------------------------------------------


@contextmanager
def _sigint_deferred() -> Iterator[threading.Event]:
    """While the body runs, Ctrl-C sets the event instead of raising: the
    engine finishes its step, so its state stays whole, and the caller aborts."""
    pressed = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield pressed  # signals only reach the main thread
        return
    previous = signal.signal(signal.SIGINT, lambda *_: pressed.set())
    try:
        yield pressed
    finally:
        signal.signal(signal.SIGINT, previous)


def stream_answer(engine: Any, request_id: str, prompt: Any, params: SamplingParams, out: TextIO) -> Any:
    """Run one request, writing its text as it grows, then a newline. Returns
    the final output, or None when Ctrl-C stopped it (the request is aborted:
    its KV blocks are freed)."""
    from omnistage.entrypoints.loading import can_speak

    engine.add_request(request_id, prompt, params, **({"return_audio": False} if can_speak(engine) else {}))
    shown = 0
    final = None
    with _sigint_deferred() as interrupted:
        while final is None and not interrupted.is_set() and engine.has_unfinished_requests():
            for o in engine.step():
                if o.request_id != request_id:
                    continue
                text = o.outputs[0].text
                out.write(text[shown:])
                out.flush()
                shown = len(text)
                if o.finished:
                    final = o
        if final is None:
            engine.abort_request(request_id)
    out.write("\n")
    out.flush()
    return final


def run_chat(args: argparse.Namespace, stdin: TextIO, out: TextIO, err: TextIO) -> int:
    _sampling_params(args)  # fail on bad flags before loading the model
    _, engine = _load(args, err)
    interactive = stdin.isatty()
    start: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(start)
    if interactive:
        err.write("omnistage chat: type a message; /help lists the commands, /exit or Ctrl-D quits\n")
    turn = 0
    while True:
        line = _read_user_line(stdin, interactive, err)
        if line is None:
            return 0
        if not line:
            continue
        if line.startswith("/"):
            command = line.split()[0]
            if command in ("/exit", "/quit"):
                return 0
            if command == "/reset":
                messages = list(start)
                err.write("[new conversation]\n")
            elif command == "/help":
                err.write(CHAT_HELP + "\n")
            else:
                err.write(f"unknown command {command}; /help lists the commands\n")
            continue
        messages.append({"role": "user", "content": line})
        turn += 1
        if interactive:
            out.write("assistant> ")
            out.flush()
        try:
            prompt = engine.encode_chat(messages)
            final = stream_answer(engine, f"turn-{turn}", prompt, _sampling_params(args, turn), out)
        except ValueError as e:  # e.g. the conversation outgrew the context: this turn is dropped
            messages.pop()
            out.write("\n")
            err.write(f"omnistage chat: error: {e} (/reset starts a new conversation)\n")
            continue
        if final is None:
            messages.pop()  # an unfinished answer is not part of the conversation
            err.write("[interrupted]\n")
            continue
        completion = final.outputs[0]
        messages.append({"role": "assistant", "content": completion.text})
        if completion.finish_reason == "length":
            used = len(completion.token_ids)
            limit = args.max_tokens
            err.write(f"[cut off: the answer reached the token limit ({used} tokens, --max-tokens {limit})]\n")
        if args.stats:
            ttft = final.metrics.time_to_first_token or 0.0
            err.write(
                f"[turn {turn}: {final.num_cached_tokens}/{len(final.prompt_token_ids)} prompt tokens "
                f"cached, TTFT {ttft * 1000:.0f} ms]\n"
            )


def _read_user_line(stdin: TextIO, interactive: bool, err: TextIO) -> str | None:
    """The next user line, stripped; None at the end of input or, on a
    terminal, at Ctrl-C (which then ends the chat cleanly, on a new line)."""
    try:
        if interactive:
            err.write("user> ")
            err.flush()
        line = stdin.readline()
    except KeyboardInterrupt:
        line = ""
    if not line:
        if interactive:
            err.write("\n")
            err.flush()
        return None
    return line.strip()


# -- main --------------------------------------------------------------------------


def _log_warnings_to_stderr() -> None:
    """omnistage's warnings (options ignored, ...) as one ``omnistage: WARNING: ...`` line each."""
    log = logging.getLogger("omnistage")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("omnistage: %(levelname)s: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the subcommand's usage, not the top-level one
        args.subparser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        if args.command != "serve":  # the server configures logging itself
            _log_warnings_to_stderr()
        if args.command == "generate":
            return run_generate(args, sys.stdout, sys.stderr)
        if args.command == "chat":
            return run_chat(args, sys.stdin, sys.stdout, sys.stderr)
        hooks = _serve_hooks()
        assert hooks is not None and args.command == "serve"
        hooks[1](args)
        return 0
    except (ValueError, OSError) as e:  # bad flags, files, model path or parameters: one line, not a traceback
        print(f"omnistage {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # e.g. while the model loads
        print(f"\nomnistage {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
