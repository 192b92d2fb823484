"""Benchmark cases for EncoderRunner.gather_mm_embeddings.

Workload: one step of 256 prefilling requests, each prompt holding 4 images of
256 embeddings (hidden 2048, bf16) separated by text, each request scheduled a
512-token window. Windows are staggered over the prompt (request i starts at
chunk i % 3), so items are split across steps in every way. Cases: the target
path, the drafter path (draft_lookahead=1), and items with is_embed masks
(16 break tokens inside each image span).

``gather_cases()`` returns ``(name, op, copy_baseline)`` triples: ``op`` runs
the gather; ``copy_baseline`` copies the same bytes (the gathered rows) into a
preallocated buffer. Run standalone for a table that adds us per gathered item
and a side-by-side straightforward reference gather (per-item key bisection,
mask mapping through PlaceholderRange, a bool-tensor slice per item).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from omnistage.multimodal.inputs import (
    MultiModalFeatureSpec,
    PlaceholderRange,
    get_mm_features_in_window,
)
from omnistage.worker.mm.encoder_cache import EncoderCache
from omnistage.worker.mm.encoder_runner import EncoderRunner

NUM_REQS = 256
IMAGES_PER_REQ = 4
EMBEDS_PER_IMAGE = 256
HIDDEN = 2048
WINDOW = 512
TEXT_GAP = 32  # text tokens before each image
BREAKS_PER_IMAGE = 16  # non-embed positions inside a masked image span
DISTINCT_OUTPUTS = 16  # identifiers are distinct; storage is shared to bound memory
DTYPE = torch.bfloat16


class Workload:
    def __init__(self, masked: bool) -> None:
        length = EMBEDS_PER_IMAGE + (BREAKS_PER_IMAGE if masked else 0)
        mask = None
        if masked:
            mask = torch.ones(length, dtype=torch.bool)
            mask[length // BREAKS_PER_IMAGE - 1 :: length // BREAKS_PER_IMAGE] = False
            assert int(mask.sum()) == EMBEDS_PER_IMAGE
        self.prompt_len = IMAGES_PER_REQ * (TEXT_GAP + length) + TEXT_GAP
        gen = torch.Generator().manual_seed(0)
        pool = [
            torch.randn(EMBEDS_PER_IMAGE, HIDDEN, generator=gen).to(DTYPE)
            for _ in range(DISTINCT_OUTPUTS)
        ]
        self.cache = EncoderCache()
        self.req_ids = [f"req{i}" for i in range(NUM_REQS)]
        for i, req_id in enumerate(self.req_ids):
            features = []
            for j in range(IMAGES_PER_REQ):
                ident = f"img-{i}-{j}"
                offset = TEXT_GAP + j * (TEXT_GAP + length)
                features.append(
                    MultiModalFeatureSpec(
                        data=None,
                        modality="image",
                        identifier=ident,
                        mm_position=PlaceholderRange(offset, length, mask),
                    )
                )
                self.cache.encoder_outputs[ident] = pool[(i * IMAGES_PER_REQ + j) % DISTINCT_OUTPUTS]
            self.cache.add_request(req_id, features)
        chunks = -(-self.prompt_len // WINDOW)
        self.num_computed = np.array([WINDOW * (i % chunks) for i in range(NUM_REQS)])
        self.num_scheduled = np.minimum(WINDOW, self.prompt_len - self.num_computed)
        self.query_start_loc = np.concatenate(([0], np.cumsum(self.num_scheduled)))
        self.prefill_lens = np.full(NUM_REQS, self.prompt_len)
        self.num_tokens = int(self.query_start_loc[-1])
        self.runner = EncoderRunner(
            model=None,
            max_num_tokens=1,  # the gather does not use the inputs_embeds buffer
            hidden_size=HIDDEN,
            encoder_cache=self.cache,
            dtype=DTYPE,
            device=torch.device("cpu"),
        )

    def args(self, draft_lookahead: int) -> tuple:
        return (
            self.req_ids,
            self.num_tokens,
            self.num_scheduled,
            self.query_start_loc,
            self.prefill_lens,
            self.num_computed,
            draft_lookahead,
        )


def reference_gather(cache: EncoderCache, req_ids, total, num_scheduled, query_start_loc,
                     prefill_lens, num_computed, draft_lookahead=0):
    """A straightforward gather with the same results, for comparison."""
    is_mm_embed = torch.zeros(total, dtype=torch.bool)
    mm_embeds = []
    nc_arr = num_computed + draft_lookahead
    if (nc_arr >= prefill_lens).all():
        return mm_embeds, is_mm_embed
    for i, req_id in enumerate(req_ids):
        qs = int(nc_arr[i])
        if qs >= int(prefill_lens[i]):
            continue
        qe = qs + int(num_scheduled[i])
        features = cache.mm_features[req_id]
        lo, hi = get_mm_features_in_window(features, qs, qe)
        for f in features[lo:hi]:
            pos = f.mm_position
            s = max(qs - pos.offset, 0)
            e = min(qe - pos.offset, pos.length)
            es, ee = pos.get_embeds_indices_in_range(s, e)
            if es == ee:
                continue
            out = cache.encoder_outputs.get(f.identifier)
            if out is None:
                if pos.offset + draft_lookahead >= qe:
                    continue
                raise RuntimeError(f"Encoder cache miss for {f.identifier}.")
            item = out[es:ee]
            item.modality = f.modality
            base = int(query_start_loc[i]) + pos.offset - qs
            piece = True if pos.is_embed is None else pos.is_embed[s:e]
            is_mm_embed[base + s : base + e] |= piece
            mm_embeds.append(item)
    return mm_embeds, is_mm_embed


_WORKLOADS: dict[bool, Workload] = {}
_COPY_BUFFER: list[torch.Tensor] = []  # one destination shared by every case


def _workload(masked: bool) -> Workload:
    if masked not in _WORKLOADS:
        _WORKLOADS[masked] = Workload(masked)
    return _WORKLOADS[masked]


def _copy_buffer(rows: int) -> torch.Tensor:
    if not _COPY_BUFFER or _COPY_BUFFER[0].shape[0] < rows:
        _COPY_BUFFER[:] = [torch.empty(rows, HIDDEN, dtype=DTYPE)]
    return _COPY_BUFFER[0]


def _case(name: str, masked: bool, draft_lookahead: int):
    w = _workload(masked)
    args = w.args(draft_lookahead)
    views, _ = w.runner.gather_mm_embeddings(*args)
    rows = sum(v.shape[0] for v in views)

    def op():
        return w.runner.gather_mm_embeddings(*args)

    def copy_baseline():
        torch.cat(views, out=_copy_buffer(rows)[:rows])

    return name, op, copy_baseline


def gather_cases() -> list[tuple[str, Callable[[], object], Callable[[], object]]]:
    torch.set_num_threads(1)
    shape = f"{NUM_REQS} req x {IMAGES_PER_REQ} img x {EMBEDS_PER_IMAGE} emb, h{HIDDEN}, {WINDOW}-tok windows"
    cases = [
        _case(f"gather_mm_embeddings ({shape})", masked=False, draft_lookahead=0),
        _case(f"gather_mm_embeddings draft_lookahead=1 ({shape})", masked=False, draft_lookahead=1),
        _case(f"gather_mm_embeddings is_embed masks ({shape})", masked=True, draft_lookahead=0),
    ]
    return cases


def best_us(fn: Callable[[], object], clock: Callable[[], float], runs: int) -> float:
    """Fastest of ``runs`` calls, in microseconds, on the given clock."""
    fn()  # warm up
    best = float("inf")
    for _ in range(runs):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return best * 1e6


def main() -> None:
    torch.set_num_threads(1)
    cases = gather_cases()
    params = [(False, 0), (False, 1), (True, 0)]
    print("op/copy: median wall time, interleaved. us/item: fastest run, wall and process CPU time;")
    print("ref: a straightforward per-item gather (same results) on CPU time.")
    print(f"{'case':<90} {'op us':>8} {'copy us':>9} {'ratio':>6} {'items':>5} "
          f"{'us/item':>8} {'cpu us/item':>11} {'ref cpu':>8} {'speedup':>7}")
    for (name, op, copy_baseline), (masked, lookahead) in zip(cases, params):
        w = _workload(masked)
        got, want = op(), reference_gather(w.cache, *w.args(lookahead))
        assert torch.equal(got[1], want[1]) and len(got[0]) == len(want[0])
        items = len(got[0])
        op_t, copy_t = [], []
        for _ in range(15):
            for fn, out in ((op, op_t), (copy_baseline, copy_t)):
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
        op_us, copy_us = statistics.median(op_t) * 1e6, statistics.median(copy_t) * 1e6
        wall = best_us(op, time.perf_counter, 200) / items
        cpu = best_us(op, time.thread_time, 200) / items
        ref = best_us(lambda: reference_gather(w.cache, *w.args(lookahead)), time.thread_time, 50) / items
        print(f"{name:<90} {op_us:>8.0f} {copy_us:>9.0f} {op_us / copy_us:>6.3f} {items:>5} "
              f"{wall:>8.2f} {cpu:>11.2f} {ref:>8.2f} {ref / cpu:>6.1f}x")


if __name__ == "__main__":
    main()
