"""Loading a model for the command line: progress while it loads, one summary line after.

``load_llm`` is the one way ``omnistage generate``, ``chat`` and ``serve`` load:
through ``LLM(model=..., **engine_kwargs)``, whatever the model kind.
``step_engine(llm)`` is the step-level engine behind it, with one contract for
every model kind: ``add_request(request_id, prompt, sampling_params)``,
``step()`` (cumulative ``RequestOutput``s), ``abort_request(id)``,
``has_unfinished_requests()``, plus ``encode_chat(messages)``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

__all__ = ["core_engine", "load_llm", "loading_progress", "step_engine", "summary_line"]

_REDRAW_SECONDS = 0.5


def load_llm(engine_kwargs: dict[str, Any], err: TextIO, omni_kwargs: dict[str, Any] | None = None) -> tuple[Any, Any]:
    """``(llm, step_engine(llm))`` for ``engine_kwargs`` (``EngineArgs`` fields),
    showing progress and then the summary line on ``err``. ``omni_kwargs``
    (``talker_params``, ...) are passed only for an omni checkpoint."""
    from omnistage.engine.arg_utils import EngineArgs

    start = time.monotonic()
    EngineArgs(**engine_kwargs)  # bad flag values fail here, before the slow part
    kwargs = dict(engine_kwargs)
    model = kwargs.pop("model", None)
    with loading_progress(f"loading {model or 'the default model'}", err):
        from omnistage.engine.omni.loader import is_omni_checkpoint
        from omnistage.entrypoints.llm import LLM  # torch and transformers: part of the wait

        if omni_kwargs and is_omni_checkpoint(model):
            kwargs.update(omni_kwargs)
        llm = LLM(model=model, **kwargs)
    engine = step_engine(llm)
    err.write(summary_line(engine, time.monotonic() - start) + "\n")
    err.flush()
    return llm, engine


def step_engine(llm: Any) -> Any:
    """The step-level engine behind an ``LLM``.

    ``llm.llm_engine`` is the contract the ``LLM`` facade keeps for every model
    kind. Today's ``OmniLLM`` (what ``LLM(model=<omni folder>)`` returns) has
    its ``OmniPipeline`` as ``llm.pipeline`` instead; ``OmniEngine`` gives it
    the same methods (text only for plain ``SamplingParams``; audio with
    ``OmniRequestParams``).
    """
    engine = getattr(llm, "llm_engine", None)
    if engine is not None:
        return engine
    from omnistage.entrypoints.openai.omni_engine import OmniEngine

    return OmniEngine(llm)


def core_engine(engine: Any) -> Any:
    """The ``LLMEngine`` whose KV pool prompts occupy (an omni model's thinker)."""
    return getattr(engine, "thinker_engine", engine)


def can_speak(engine: Any) -> bool:
    return "audio" in (getattr(engine, "output_modalities", None) or ())


def summary_line(engine: Any, seconds: float) -> str:
    """``loaded NAME (dtype, device) in S s: KV cache B blocks x T tokens = N tokens, context L``."""
    core = core_engine(engine)
    loaded = core.loaded_model
    dtype = str(getattr(loaded.model, "dtype", core.args.dtype)).removeprefix("torch.")
    block = core.args.block_size
    speaks = ", speaks" if can_speak(engine) else ""
    return (
        f"omnistage: loaded {loaded.name} ({dtype}, {core.args.device}{speaks}) in {seconds:.1f} s: "
        f"KV cache {core.num_kv_blocks} blocks x {block} tokens = {core.num_kv_blocks * block} tokens, "
        f"context {core.max_model_len} tokens"
    )


@contextmanager
def loading_progress(what: str, err: TextIO) -> Iterator[None]:
    """Say that ``what`` is under way while the body runs: on a terminal one
    line redrawn with the seconds elapsed, elsewhere (a log, a pipe) one line."""
    interactive = getattr(err, "isatty", lambda: False)()
    if not interactive:
        err.write(f"omnistage: {what} ...\n")
        err.flush()
        yield
        return
    done = threading.Event()
    start = time.monotonic()

    def redraw() -> None:
        while not done.wait(_REDRAW_SECONDS):
            err.write(f"\romnistage: {what} ... {time.monotonic() - start:.0f} s")
            err.flush()

    err.write(f"omnistage: {what} ...")
    err.flush()
    painter = threading.Thread(target=redraw, name="omnistage-load-progress", daemon=True)
    painter.start()
    try:
        yield
    finally:
        done.set()
        painter.join()
        err.write("\r\x1b[K")  # the summary line (or the error) takes its place
        err.flush()
