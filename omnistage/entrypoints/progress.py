"""The ``Processed prompts`` progress bar of ``LLM.generate`` / ``LLM.chat``.

Policy: the count advances once per finished request, and the bar is redrawn
at that moment (tqdm's own throttle would otherwise hide the requests that
finish within 0.1 s of each other, which is most of them when a batch hits
``max_tokens`` together). The postfix shows input and output tokens/s since
the bar opened: a request's prompt tokens count once its first output
arrives (its prefill is done), its generated tokens as they arrive, so the
rates move while long requests are still running. Between finishes the bar is
redrawn at most every ``REDRAW_S`` seconds.
"""

from __future__ import annotations

import time
from typing import IO, Any

from omnistage.outputs import RequestOutput

try:
    from tqdm.auto import tqdm
except ImportError:  # tqdm comes with transformers, but stay usable without it
    tqdm = None

REDRAW_S = 0.5


def speed_postfix(input_tokens: int, output_tokens: int, elapsed_s: float) -> str:
    """``est. speed input: X toks/s, output: Y toks/s`` (vLLM's wording)."""
    elapsed_s = max(elapsed_s, 1e-9)
    return f"est. speed input: {input_tokens / elapsed_s:.2f} toks/s, output: {output_tokens / elapsed_s:.2f} toks/s"


class ProgressBar:
    """Feed it every ``RequestOutput`` of the batch as the engine returns it."""

    def __init__(self, total: int, file: IO[str] | None = None) -> None:
        self._bar: Any = None
        if tqdm is not None:
            self._bar = tqdm(
                total=total, desc="Processed prompts", dynamic_ncols=True, file=file,
                postfix=speed_postfix(0, 0, 1.0),
            )
        self._start = time.monotonic()
        self._last_draw = self._start
        self._prompt_tokens: dict[str, int] = {}  # request id -> prompt length, once prefilled
        self._generated: dict[str, int] = {}  # request id -> tokens generated so far (all choices)
        self.input_tokens = 0
        self.output_tokens = 0

    def update(self, out: RequestOutput) -> None:
        rid = out.request_id
        if rid not in self._prompt_tokens:
            self._prompt_tokens[rid] = len(out.prompt_token_ids)
            self.input_tokens += len(out.prompt_token_ids)
        generated = sum(len(c.token_ids) for c in out.outputs)  # outputs are cumulative
        self.output_tokens += generated - self._generated.get(rid, 0)
        self._generated[rid] = generated
        if self._bar is None:
            return
        now = time.monotonic()
        if not out.finished and now - self._last_draw < REDRAW_S:
            return
        self._bar.set_postfix_str(speed_postfix(self.input_tokens, self.output_tokens, now - self._start), refresh=False)
        if out.finished:
            self._bar.n += 1  # not update(1): that may draw too, and this draws exactly once
        self._bar.refresh()
        self._last_draw = now

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
