"""Loading a model for the command line: progress while it loads, one summary line after.

``load_llm`` is the one way ``omnistage generate``, ``chat`` and ``serve`` load:
through ``LLM(model=..., **engine_kwargs)``, whatever the model kind. The
command then drives ``llm.llm_engine``, which has one contract for every
model kind: ``add_request(request_id, prompt, sampling_params, **audio
options)``, ``step()`` (cumulative ``RequestOutput``s), ``abort_request(id)``,
``has_unfinished_requests()``, ``encode_chat(messages)``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

__all__ = ["can_speak", "core_engine", "load_llm", "loading_progress", "summary_line"]

_REDRAW_SECONDS = 0.5


def load_llm(engine_kwargs: dict[str, Any], err: TextIO, omni_kwargs: dict[str, Any] | None = None) -> tuple[Any, Any]:
    """``(llm, llm.llm_engine)`` for ``engine_kwargs`` (``EngineArgs`` fields),
    showing progress and then the summary line on ``err``. ``omni_kwargs``
    (``talker_params``, ...) are passed only for an omni checkpoint."""
    from omnistage.engine.arg_utils import EngineArgs

    start = time.monotonic()
    EngineArgs(**engine_kwargs)  # bad flag values fail here, before the slow part
    kwargs = dict(engine_kwargs)
    model = kwargs.pop("model", None)
    with loading_progress(f"loading {model or 'the default model'}", err):
        from omnistage.entrypoints.llm import LLM  # torch and transformers: part of the wait
        from omnistage.models.qwen2_5_omni import is_omni_checkpoint

        if omni_kwargs and is_omni_checkpoint(model):
            kwargs.update(omni_kwargs)
        llm = LLM(model=model, **kwargs)
    engine = llm.llm_engine
    err.write(summary_line(engine, time.monotonic() - start) + "\n")
    err.flush()
    return llm, engine


def core_engine(engine: Any) -> Any:
    """The stage whose KV pool prompts occupy (an omni pipeline's thinker)."""
    return getattr(engine, "thinker", engine)


def can_speak(engine: Any) -> bool:
    return "audio" in engine.output_modalities


def summary_line(engine: Any, seconds: float) -> str:
    """``loaded NAME (dtype, device) in S s: KV cache B blocks x T tokens = N tokens, context L``."""
    core = core_engine(engine)
    loaded = core.loaded_model
    # A data-parallel engine holds no model here: its dtype is the one asked for.
    dtype = str(getattr(getattr(loaded, "model", None), "dtype", core.args.dtype)).removeprefix("torch.")
    block = core.args.block_size
    speaks = ", speaks" if can_speak(engine) else ""
    replicas = core.args.data_parallel_size
    each = f" in each of {replicas} replicas (Ray)" if replicas > 1 else ""
    return (
        f"omnistage: loaded {loaded.name} ({dtype}, {core.args.device}{speaks}) in {seconds:.1f} s: "
        f"KV cache {core.num_kv_blocks} blocks x {block} tokens = {core.num_kv_blocks * block} tokens{each}, "
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
