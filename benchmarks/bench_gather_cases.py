"""Benchmark cases for EncoderRunner.gather_mm_embeddings, this tree against a baseline revision.

Workloads, one prefill step each (hidden 2048, bf16 encoder outputs):

* ``images``: 256 requests, each prompt holding 4 images of 256 embeddings
  separated by 32 text tokens, each request scheduled a 512-token window.
  Windows are staggered over the prompt (request i starts at chunk i % 3), so
  items are split across steps in every way.
* ``images, draft_lookahead=1``: the same step as the drafter reads it.
* ``images, is_embed masks``: the same with 16 break tokens inside each image
  span (the ``is_embed`` mask path).
* ``small items, is_embed masks``: 32 requests whose prompts hold 96 small
  items (18 placeholders, 16 embeds: a frame with a timestamp pair), 2 text
  tokens apart; a 512-token window holds about 26 items.

Run standalone to time this tree's gather against the code of a baseline
revision (default ``27cadf0``, the start of issue 17), side by side in one run:
the baseline's ``encoder_cache.py`` and ``encoder_runner.py`` are extracted with
``git archive`` (or read from ``--baseline-dir``, a checkout of that revision)
and imported under private module names, each with its own ``EncoderCache``
filled with the same items and outputs. Old and new calls alternate, round
after round, each timed on the thread's CPU clock (``time.thread_time``: on a
shared, loaded machine wall time mostly measures the scheduler) and on the
wall clock. The table gives each side's median CPU time with its spread
(min-max over rounds), the median of the per-round CPU-time ratios with their
interquartile range, and the ratio of wall-time medians. Both sides' results are
checked equal (same rows, same mask, same modalities) before timing.

``gather_cases()`` returns ``(name, op, copy_baseline)`` triples for
``benchmarks/bench_cache_ops.py``: ``op`` runs this tree's gather;
``copy_baseline`` copies the same bytes (the gathered rows) into a
preallocated buffer.

Usage: python benchmarks/bench_gather_cases.py [--rounds N] [--baseline-rev REV | --baseline-dir DIR]
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import io
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

from omnistage.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from omnistage.worker.mm import encoder_cache as new_cache_module
from omnistage.worker.mm import encoder_runner as new_runner_module

HIDDEN = 2048
DTYPE = torch.bfloat16
DISTINCT_OUTPUTS = 16  # identifiers are distinct; storage is shared to bound memory
MM_DIR = "omnistage/worker/mm"


@dataclass(frozen=True)
class Shape:
    num_reqs: int
    items_per_req: int
    embeds_per_item: int
    breaks_per_item: int  # non-embed positions inside each item's span
    text_gap: int  # text tokens before each item
    window: int  # tokens scheduled per request

    def describe(self) -> str:
        masked = f" (+{self.breaks_per_item} breaks)" if self.breaks_per_item else ""
        return (
            f"{self.num_reqs} req x {self.items_per_req} items x {self.embeds_per_item} emb{masked}, "
            f"{self.window}-tok windows"
        )


IMAGES = Shape(256, 4, 256, 0, 32, 512)
MASKED_IMAGES = Shape(256, 4, 256, 16, 32, 512)
SMALL_ITEMS = Shape(32, 96, 16, 2, 2, 512)
CASES = [  # (label, shape, draft_lookahead)
    ("images", IMAGES, 0),
    ("images, draft_lookahead=1", IMAGES, 1),
    ("images, is_embed masks", MASKED_IMAGES, 0),
    ("small items, is_embed masks", SMALL_ITEMS, 0),
]


def _item_mask(shape: Shape) -> torch.Tensor | None:
    if not shape.breaks_per_item:
        return None
    length = shape.embeds_per_item + shape.breaks_per_item
    mask = torch.ones(length, dtype=torch.bool)
    step = length // shape.breaks_per_item
    mask[step - 1 :: step] = False
    assert int(mask.sum()) == shape.embeds_per_item
    return mask


class Workload:
    """One step's batch arrays plus a runner per implementation, each with its
    own cache holding the same items and (shared) output tensors."""

    def __init__(
        self, shape: Shape, implementations: dict[str, tuple[ModuleType, ModuleType]]
    ) -> None:
        mask = _item_mask(shape)
        length = shape.embeds_per_item + shape.breaks_per_item
        self.prompt_len = (
            shape.items_per_req * (shape.text_gap + length) + shape.text_gap
        )
        gen = torch.Generator().manual_seed(0)
        with torch.inference_mode():  # as the runner's encoder makes them
            pool = [
                torch.randn(shape.embeds_per_item, HIDDEN, generator=gen).to(DTYPE)
                for _ in range(DISTINCT_OUTPUTS)
            ]
        self.req_ids = [f"req{i}" for i in range(shape.num_reqs)]
        features = {}
        outputs = {}
        for i, req_id in enumerate(self.req_ids):
            features[req_id] = []
            for j in range(shape.items_per_req):
                ident = f"item-{i}-{j}"
                offset = shape.text_gap + j * (shape.text_gap + length)
                features[req_id].append(
                    MultiModalFeatureSpec(
                        data=None,
                        modality="image",
                        identifier=ident,
                        mm_position=PlaceholderRange(offset, length, mask),
                    )
                )
                outputs[ident] = pool[(i * shape.items_per_req + j) % DISTINCT_OUTPUTS]
        chunks = -(-self.prompt_len // shape.window)
        self.num_computed = np.array(
            [shape.window * (i % chunks) for i in range(shape.num_reqs)]
        )
        self.num_scheduled = np.minimum(
            shape.window, self.prompt_len - self.num_computed
        )
        self.query_start_loc = np.concatenate(([0], np.cumsum(self.num_scheduled)))
        self.prefill_lens = np.full(shape.num_reqs, self.prompt_len)
        self.num_tokens = int(self.query_start_loc[-1])
        self.runners = {}
        for name, (cache_module, runner_module) in implementations.items():
            cache = cache_module.EncoderCache()
            for req_id in self.req_ids:
                cache.add_request(req_id, features[req_id])
            cache.encoder_outputs.update(outputs)
            self.runners[name] = runner_module.EncoderRunner(
                model=None,
                max_num_tokens=1,  # the gather does not use the inputs_embeds buffer
                hidden_size=HIDDEN,
                encoder_cache=cache,
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

    def op(self, implementation: str, draft_lookahead: int) -> Callable[[], object]:
        gather = self.runners[implementation].gather_mm_embeddings
        args = self.args(draft_lookahead)
        return lambda: gather(*args)


# ---------------------------------------------------------------- baseline import


def _extract_baseline(rev: str) -> Path:
    """``omnistage/worker/mm`` of ``rev`` in a temporary folder (removed at exit), via git archive."""
    root = Path(__file__).resolve().parent.parent
    blob = subprocess.run(
        ["git", "-C", str(root), "archive", "--format=tar", rev, MM_DIR],
        check=True,
        capture_output=True,
    ).stdout
    folder = Path(tempfile.mkdtemp(prefix=f"gather-baseline-{rev}-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)  # its modules are imported by then
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        tar.extractall(folder, filter="data")
    return folder


def load_baseline(folder: Path, tag: str) -> tuple[ModuleType, ModuleType]:
    """Import a tree's encoder cache and runner under private names. The
    runner's ``from omnistage.worker.mm.encoder_cache import ...`` is pointed
    at that tree's cache while it executes, so neither touches this tree's."""
    modules = []
    saved = sys.modules.get("omnistage.worker.mm.encoder_cache")
    try:
        for stem in ("encoder_cache", "encoder_runner"):
            name = f"_gather_{tag}_{stem}"
            spec = importlib.util.spec_from_file_location(
                name, folder / MM_DIR / f"{stem}.py"
            )
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
            modules.append(module)
            if stem == "encoder_cache":
                sys.modules["omnistage.worker.mm.encoder_cache"] = module
    finally:
        sys.modules["omnistage.worker.mm.encoder_cache"] = saved
    return modules[0], modules[1]


# ---------------------------------------------------------------- cases for bench_cache_ops

_WORKLOADS: dict[Shape, Workload] = {}
_COPY_BUFFER: list[torch.Tensor] = []  # one destination shared by every case


def _workload(shape: Shape) -> Workload:
    if shape not in _WORKLOADS:
        _WORKLOADS[shape] = Workload(
            shape, {"new": (new_cache_module, new_runner_module)}
        )
    return _WORKLOADS[shape]


def _copy_buffer(rows: int) -> torch.Tensor:
    if not _COPY_BUFFER or _COPY_BUFFER[0].shape[0] < rows:
        _COPY_BUFFER[:] = [torch.empty(rows, HIDDEN, dtype=DTYPE)]
    return _COPY_BUFFER[0]


def gather_cases() -> list[tuple[str, Callable[[], object], Callable[[], object]]]:
    torch.set_num_threads(1)
    cases = []
    for label, shape, lookahead in CASES:
        op = _workload(shape).op("new", lookahead)
        views, _ = op()
        rows = sum(v.shape[0] for v in views)

        def copy_baseline(views=views, rows=rows):
            torch.cat(views, out=_copy_buffer(rows)[:rows])

        cases.append(
            (f"gather_mm_embeddings {label} ({shape.describe()})", op, copy_baseline)
        )
    return cases


# ---------------------------------------------------------------- side by side


def _same_result(a, b) -> bool:
    (rows_a, mask_a), (rows_b, mask_b) = a, b
    return (
        torch.equal(mask_a, mask_b)
        and len(rows_a) == len(rows_b)
        and all(
            x.modality == y.modality and torch.equal(x, y)
            for x, y in zip(rows_a, rows_b)
        )
    )


def _with_merge_prep(op: Callable[[], object]) -> Callable[[], object]:
    """``op`` followed by what ``get_inputs_embeds`` does with its rows before
    the copy: for a ``GatheredRows`` its row count and plain tensors, for a
    list of views (the baseline) the sum of their row counts."""

    def run():
        rows, mask = op()
        if hasattr(rows, "tensors"):
            return rows.num_rows, rows.tensors(), mask
        return sum(t.shape[0] for t in rows), rows, mask

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rounds", type=int, default=40, help="interleaved old/new calls per case"
    )
    parser.add_argument(
        "--baseline-rev",
        default="27cadf0",
        help="git revision of the baseline (git archive)",
    )
    parser.add_argument(
        "--baseline-dir",
        type=Path,
        help="a checkout of the baseline instead of --baseline-rev",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    folder = args.baseline_dir or _extract_baseline(args.baseline_rev)
    old = load_baseline(folder, "old")
    implementations = {"old": old, "new": (new_cache_module, new_runner_module)}
    print(
        f"baseline: {args.baseline_dir or args.baseline_rev}; load before: {os.getloadavg()}"
    )
    print(
        "CPU us per call: median (min-max) over interleaved rounds; speedup: median of per-round old/new CPU"
    )
    header = f"{'case':<34} {'items':>5} {'old cpu us':>20} {'new cpu us':>20} {'speedup':>8} {'IQR':>11} {'wall':>7} {'+merge':>7}"
    print(header)
    workloads: dict[Shape, Workload] = {}
    for label, shape, lookahead in CASES:
        if shape not in workloads:
            workloads[shape] = Workload(shape, implementations)
        w = workloads[shape]
        ops = {name: w.op(name, lookahead) for name in implementations}
        results = {name: op() for name, op in ops.items()}
        ops["old+merge"] = _with_merge_prep(ops["old"])
        ops["new+merge"] = _with_merge_prep(ops["new"])
        assert _same_result(results["old"], results["new"]), (
            f"{label}: old and new results differ"
        )
        items = len(results["new"][0])
        cpu: dict[str, list[float]] = {name: [] for name in ops}
        wall: dict[str, list[float]] = {name: [] for name in ops}
        for _ in range(3):  # warm up
            for op in ops.values():
                op()
        for r in range(args.rounds):
            order = list(ops.items()) if r % 2 == 0 else list(reversed(ops.items()))
            for name, op in order:
                w0, c0 = time.perf_counter(), time.thread_time()
                op()
                c1, w1 = time.thread_time(), time.perf_counter()
                cpu[name].append((c1 - c0) * 1e6)
                wall[name].append((w1 - w0) * 1e6)
        ratios = [o / n for o, n in zip(cpu["old"], cpu["new"])]
        merge_ratio = statistics.median(
            o / n for o, n in zip(cpu["old+merge"], cpu["new+merge"])
        )
        cells = [
            f"{statistics.median(t):>6.0f} ({min(t):.0f}-{max(t):.0f})"
            for t in (cpu["old"], cpu["new"])
        ]
        q = statistics.quantiles(ratios, n=4)
        wall_ratio = statistics.median(wall["old"]) / statistics.median(wall["new"])
        print(
            f"{label:<34} {items:>5} {cells[0]:>20} {cells[1]:>20} {statistics.median(ratios):>7.2f}x "
            f"{q[0]:>5.2f}-{q[2]:.2f}x {wall_ratio:>6.2f}x {merge_ratio:>6.2f}x"
        )
    print(
        "+merge: median per-round ratio with each side's get_inputs_embeds work before its copy "
        "(old: sum of the views' rows; new: num_rows and tensors())"
    )
    print(
        f"spread: interquartile range of the per-round ratios. load after: {os.getloadavg()}"
    )


if __name__ == "__main__":
    main()
