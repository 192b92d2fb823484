"""What a step costs on this machine, relative to a one-token decode step: measured for the draft policy.

Speculation pays only while a verified draft costs less than the tokens it is
expected to add (``core/spec_policy.py``), and that price depends on the CPU:
a machine whose 1-2 row matmuls are much faster than its wider ones pays more
for a verify step than one whose kernels scale evenly. So a speculating engine
measures it once, when it starts (:func:`measure_step_costs`):

- **What is timed**: the engine's own forward and greedy token choice over
  synthetic requests, ``B`` rows of ``q`` tokens each, continuing the dense
  decode views as a running batch does: plain decode steps (``q = 1``) at
  ``B = 1, 2, 3, 8`` and verify steps (``q = 1 + drafts``) at ``B = 1`` and
  ``B = 8``, up to ``1 + k`` tokens per row (``DECODE_SHAPES``,
  ``VERIFY_SHAPES``). The scheduler's own Python is left out: it costs a
  verify step a little more than a decode step, so the measured price of a
  draft is, if anything, low by that much.
- **Where**: in KV blocks ``0..n`` of the engine's cache, which hold nothing
  while the engine starts (every block is free); the dense decode views are
  released afterwards, so no step that follows can read what these wrote.
- **Noise**: a warm-up pass, then ``rounds`` passes over all shapes, in
  alternating order; each shape keeps its fastest step (load only ever adds
  time), and no shape costs more than one with as many rows and tokens per
  row or more (``_undo_load_spikes``).
- **Cost**: on the embedded default model at 2 threads, about a second at
  engine start.

The result is a ``StepCost``, every time divided by the one-row decode
step's: plain decode steps by row count, and verify steps by token count at
1 and at 8 rows (what a draft adds depends on the rows it joins). Shapes
that do not fit (fewer requests or KV blocks than they need) are skipped;
where too few fit, the built-in curve stays.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from omnistage.attention.kv_cache import release_dense_view
from omnistage.attention.paged_attention import build_attention_metadata
from omnistage.core.spec_policy import StepCost
from omnistage.sampling_params import SamplingParams
from omnistage.worker.input_batch import InputBatch

__all__ = ["measure_step_costs"]

# (rows, tokens per row) of the timed shapes; verify shapes are cut at 1 + k tokens per row.
# Past the last point each curve goes on linearly, as measured steps of more tokens do.
DECODE_SHAPES = ((1, 1), (2, 1), (3, 1), (8, 1))
VERIFY_SHAPES = ((1, 2), (1, 3), (1, 4), (1, 6), (1, 9), (8, 2), (8, 3), (8, 5))
CONTEXT = 48  # tokens each synthetic request holds before its first step
# Untimed decode steps before a timed one: the second builds the batch's dense views, the timed one reads them.
LEAD_IN = 2


def measure_step_costs(runner, max_drafts: int, rounds: int = 2) -> StepCost | None:
    """The draft policy's ``StepCost`` for ``runner``'s model on this machine (see the module
    docstring); ``None`` where the KV cache or ``max_model_len`` is too small for two points."""
    verify = [(b, q) for b, q in VERIFY_SHAPES if q <= 1 + max_drafts] or [(1, 1 + max_drafts)]
    length = CONTEXT + LEAD_IN + max(q for _, q in verify)
    blocks_per_row = -(-length // runner.block_size)
    fits = length <= runner.input_batch.max_model_len
    shapes = [
        (b, q) for b, q in (*DECODE_SHAPES, *verify)
        if fits and b <= runner.input_batch.max_num_reqs and b * blocks_per_row <= runner.kv_caches[0].shape[2]
    ]  # fmt: skip
    if (1, 1) not in shapes or len(shapes) < 3:
        return None
    step = _StepRunner(runner, max(b for b, _ in shapes), length, blocks_per_row)
    try:
        with torch.inference_mode():
            for b, q in shapes:  # warm-up: buffers sized, weights in cache
                step.seconds(b, q, lead_in=0)
            best = dict.fromkeys(shapes, float("inf"))
            for r in range(rounds):
                for s in shapes if r % 2 == 0 else shapes[::-1]:
                    best[s] = min(best[s], step.seconds(*s, lead_in=LEAD_IN))
    finally:
        for cache in runner.kv_caches:
            release_dense_view(cache)
    best = _undo_load_spikes(best)
    unit = best[1, 1]
    decode = {b: t / unit for (b, q), t in best.items() if q == 1}
    # A curve per measured row count, from its plain decode step (b rows, b tokens) on.
    curves = {
        b: sorted([(b, decode[b]), *((r * q, t / unit) for (r, q), t in best.items() if r == b and q > 1)])
        for b in sorted({b for b, q in best if q > 1} & decode.keys())
    }
    if len(decode) < 2 or 1 not in curves:
        return None
    return StepCost(curves, sorted(decode.items()))


def _undo_load_spikes(seconds: dict[tuple[int, int], float]) -> dict[tuple[int, int], float]:
    """Each shape's time, lowered to that of any shape with as many rows and tokens per
    row or more that measured faster. A step never costs less for more work, and load
    only ever adds time, so such a pair means load hit the smaller shape in every round.
    Left alone, one spike on the 8-row decode step can make a verify step of 8 rows look
    cheaper than decoding them, so that drafts which are never kept look worth verifying."""
    out = dict(seconds)
    for shape in sorted(out, reverse=True):  # larger shapes first: a shape's dominators are settled
        rows, per_row = shape
        larger = [t for (b, q), t in out.items() if b >= rows and q >= per_row and (b, q) != shape]
        out[shape] = min([out[shape], *larger])
    return out


class _StepRunner:
    """Synthetic requests in a private ``InputBatch`` over KV blocks ``0..n``, and timed steps over them."""

    def __init__(self, runner, max_rows: int, max_len: int, blocks_per_row: int) -> None:
        self.runner = runner
        self.model = runner.model
        self.block_size = runner.block_size
        self.batch = InputBatch(max_rows, max_len, self.block_size, runner.device)
        vocab = self.model.vocab_size
        params = SamplingParams(temperature=0.0, max_tokens=1)
        for i in range(max_rows):
            tokens = ((np.arange(max_len) * 31 + i * 7) % vocab).tolist()
            self.batch.add_request(
                f"step-cost-{i}", tokens, CONTEXT, 0, list(range(i * blocks_per_row, (i + 1) * blocks_per_row)), params
            )
        self.mrope = runner.model_state is not None  # such a model runs at [3, T] positions
        self.begin_step: Callable | None = getattr(runner.mm_adapter, "begin_step", None)
        greedy = getattr(self.model, "greedy_token_ids", None)
        self.choose = greedy if greedy is not None else (lambda rows: self.model.compute_logits(rows).argmax(-1))
        # A device runs asynchronously: a step is over when the device says so.
        self.sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)

    def seconds(self, rows: int, per_row: int, lead_in: int) -> float:
        """Seconds of one step of ``rows`` requests with ``per_row`` tokens each, after
        ``lead_in`` untimed one-token steps of the same requests."""
        batch = self.batch
        batch.num_computed_tokens_cpu[:] = CONTEXT
        for n in [1] * lead_in + [per_row]:
            batch.num_tokens[:rows] = batch.num_computed_tokens_cpu[:rows] + n
            step = batch.prepare_step(dict.fromkeys(batch.req_ids[:rows], n))
            start = time.perf_counter()
            self._step(step)
            self.sync()
            elapsed = time.perf_counter() - start
            batch.num_computed_tokens_cpu[:rows] += n
        return elapsed

    def _step(self, step) -> None:
        positions = step.positions.expand(3, -1).contiguous() if self.mrope else step.positions
        if self.begin_step is not None:
            self.begin_step([], None)
        metadata = build_attention_metadata(step, self.block_size)
        hidden = self.model.forward(step.input_ids, positions, metadata, self.runner.kv_caches)
        self.choose(hidden)  # every row samples: a decode row, or a verified run's positions
