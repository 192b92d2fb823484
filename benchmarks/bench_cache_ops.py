"""Tensor prefix cache operations, each timed against a plain copy of the bytes it must move.

Every case pairs an operation with ``dst.copy_(src)`` of the bytes that operation
has to move (rows written for an update; cached plus new rows for a merge; the
new rows for a merge without hits, which a GPU runner would have to bring to the
host anyway), measured interleaved in the same run on one torch thread. The
ratio ``op / copy`` is the number to watch; absolute times depend on the machine.

Targets: update within 2x of the copy, a no-hit decode merge within 3x, every
merge with hits within 2x.

A merge with hits returns fresh buffers. By default glibc serves large ones
(> 32 MiB, or after a big free is trimmed) as new pages, faulted in on first
touch; the engine turns that off at start-up (``keep_freed_host_memory``) and so
does this script, as the engine would. ``--default-malloc`` measures without it;
the ``ref: fresh buffer + copy`` row shows that floor either way.

Usage: python benchmarks/bench_cache_ops.py [--quick]

More cases (e.g. the encoder's ``gather_mm_embeddings``) are appended from
``benchmarks/bench_gather_cases.py`` when it exists: it defines ``gather_cases()``
returning ``(name, op, copy)`` triples of zero-argument callables.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

import numpy as np
import torch

from omnistage.worker.host_memory import keep_freed_host_memory
from omnistage.worker.tensor_prefix_cache import OmniTensorPrefixCache

HIDDEN = 2048
BLOCK = 16
NUM_BLOCKS = 1536  # 24,576 token slots: room for every case's blocks without reuse
CODES_WIDTH = 16


class Case(NamedTuple):
    name: str
    op: Callable[[], Any]
    copy: Callable[[], Any]


def copy_of(nbytes: int) -> Callable[[], Any]:
    """A plain copy of ``nbytes`` into a preallocated buffer."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def row_bytes(dtype: torch.dtype, width: int = HIDDEN) -> int:
    return width * torch.empty((), dtype=dtype).element_size()


def make_batch(requests: list[tuple[str, int, list[int]]]) -> Any:
    """A batch of (req_id, num_computed_tokens, block_ids), as the real InputBatch when present."""
    try:
        from omnistage.sampling_params import SamplingParams
        from omnistage.worker.input_batch import InputBatch
    except ImportError:
        return _namespace_batch(requests)
    max_len = max(len(blocks) for _, _, blocks in requests) * BLOCK
    batch = InputBatch(max_num_reqs=len(requests), max_model_len=max_len, block_size=BLOCK)
    for req_id, computed, blocks in requests:
        batch.add_request(req_id, [1] * max_len, max_len, computed, blocks, SamplingParams())
    return batch


def _namespace_batch(requests: list[tuple[str, int, list[int]]]) -> Any:
    width = max(len(blocks) for _, _, blocks in requests)
    table = torch.zeros((len(requests), width), dtype=torch.int32)
    for i, (_, _, blocks) in enumerate(requests):
        table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    group = SimpleNamespace(
        block_table=SimpleNamespace(cpu=table),
        num_blocks_per_row=np.array([len(b) for _, _, b in requests], dtype=np.int32),
    )
    return SimpleNamespace(
        req_ids=[r for r, _, _ in requests],
        req_id_to_index={r: i for i, (r, _, _) in enumerate(requests)},
        num_computed_tokens_cpu=np.array([c for _, c, _ in requests], dtype=np.int64),
        block_table=_Groups([group]),
    )


class _Groups:
    def __init__(self, groups: list[Any]) -> None:
        self.block_tables = groups

    def __getitem__(self, idx: int) -> Any:
        return self.block_tables[idx]


class Step(NamedTuple):
    batch: Any
    query_start_loc: np.ndarray
    num_scheduled: dict[str, int]
    hits: list[str]
    num_new: int
    num_cached: int


def make_step(num_decode: int, num_hits: int, cached_per_hit: int, new_per_hit: int, rng: np.random.Generator) -> Step:
    """Hit requests first (cached prefix + new tail), then decode requests (one token each)."""
    blocks = iter(rng.permutation(NUM_BLOCKS).tolist())
    requests, num_scheduled = [], {}
    for i in range(num_hits):
        total = cached_per_hit + new_per_hit
        requests.append((f"hit{i}", cached_per_hit, [next(blocks) for _ in range(-(-total // BLOCK))]))
        num_scheduled[f"hit{i}"] = new_per_hit
    for i in range(num_decode):
        requests.append((f"dec{i}", 100, [next(blocks) for _ in range(7)]))
        num_scheduled[f"dec{i}"] = 1
    qsl = np.zeros(len(requests) + 1, dtype=np.int64)
    np.cumsum([num_scheduled[r] for r, _, _ in requests], out=qsl[1:])
    hits = [r for r, _, _ in requests[:num_hits]]
    return Step(make_batch(requests), qsl, num_scheduled, hits, int(qsl[-1]), num_hits * cached_per_hit)


def primed_cache(
    dtype: torch.dtype, step: Step, mm_keys: dict[str, torch.dtype] | None = None
) -> OmniTensorPrefixCache:
    """A cache whose hit blocks of ``step`` hold written rows for hidden states and ``mm_keys``."""
    cache = OmniTensorPrefixCache(num_blocks=NUM_BLOCKS, block_size=BLOCK, hidden_size=HIDDEN, hs_dtype=dtype)
    table = step.batch.block_table[0].block_table.cpu
    for req_id in step.hits:
        idx = step.batch.req_id_to_index[req_id]
        n = int(step.batch.num_computed_tokens_cpu[idx])
        slots = (table[idx, : n // BLOCK].long()[:, None] * BLOCK + torch.arange(BLOCK)).reshape(-1)
        mm = {k: torch.ones((n, _width(k)), dtype=dt) for k, dt in (mm_keys or {}).items()}
        cache.update_omni_tensor_prefix_cache(torch.ones((n, HIDDEN), dtype=dtype), mm, n, slots)
        cache.add_prefix_cached_new_req_id(req_id)
    return cache


def _width(key: str) -> int:
    return CODES_WIDTH if key.startswith("codes") else HIDDEN


def update_cases(dtype: torch.dtype, rng: np.random.Generator) -> list[Case]:
    cases = []
    cache = OmniTensorPrefixCache(num_blocks=NUM_BLOCKS, block_size=BLOCK, hidden_size=HIDDEN, hs_dtype=dtype)
    for name, n in (("update prefill 8192", 8192), ("update decode 64", 64)):
        if n == 8192:  # a prefill fills whole blocks, in the (arbitrary) order the allocator gave them
            blocks = torch.from_numpy(rng.permutation(NUM_BLOCKS)[: n // BLOCK])
            slots = (blocks[:, None] * BLOCK + torch.arange(BLOCK)).reshape(-1)
        else:  # one token each into 64 different blocks
            slots = torch.from_numpy(rng.permutation(NUM_BLOCKS * BLOCK)[:n])
        hidden = torch.randn(n, HIDDEN).to(dtype)
        op = (lambda c=cache, h=hidden, s=slots, n=n: c.update_omni_tensor_prefix_cache(h, None, n, s))
        cases.append(Case(name, op, copy_of(n * row_bytes(dtype))))
    return cases


def merge_cases(dtype: torch.dtype, rng: np.random.Generator) -> list[Case]:
    cases = []
    shapes = (
        ("merge decode 64, no hits", 64, 0, 0, 0),
        ("merge 64 reqs, 8 hit 1024", 56, 8, 1024, 16),
        ("merge 1 req hits 8192", 0, 1, 8192, 16),
    )
    for name, num_decode, num_hits, cached, new in shapes:
        step = make_step(num_decode, num_hits, cached, new, rng)
        cache = primed_cache(dtype, step)
        hidden = torch.randn(step.num_new, HIDDEN).to(dtype)

        def op(c=cache, s=step, h=hidden):
            return c.get_merged_hidden_states(s.query_start_loc, s.batch, h, s.num_scheduled)

        cases.append(Case(name, op, copy_of((step.num_cached + step.num_new) * row_bytes(dtype))))

    step = make_step(56, 8, 1024, 16, rng)
    keys = {"hidden_states.layer_24": dtype, "codes.audio": torch.int64}
    cache = primed_cache(dtype, step, keys)
    outputs = {k: torch.ones((step.num_new, _width(k)), dtype=dt) for k, dt in keys.items()}
    outputs["meta.ref_code_len"] = torch.arange(step.num_new, dtype=torch.int32)  # 1-D: passthrough

    def mm_op(c=cache, s=step, o=outputs):
        return c.get_merged_multimodal_states(s.query_start_loc, s.batch, o, s.num_scheduled)

    per_row = sum(row_bytes(dt, _width(k)) for k, dt in keys.items())
    nbytes = (step.num_cached + step.num_new) * per_row + step.num_new * 4
    cases.append(Case("mm merge 2 keys + 1-D, 8 hit 1024", mm_op, copy_of(nbytes)))

    # Reference, not a cache op: a merge with hits must return a fresh buffer, and the first
    # touch of fresh memory (page faults) is paid on top of the copy. This row shows that floor.
    nbytes = (8192 + 16) * row_bytes(dtype)
    src = torch.ones(nbytes, dtype=torch.uint8)

    def fresh_copy(src: torch.Tensor = src) -> torch.Tensor:
        return torch.empty_like(src).copy_(src)

    cases.append(Case("ref: fresh buffer + copy, 8192+16 rows", fresh_copy, copy_of(nbytes)))
    return cases


def cache_cases(dtypes: Iterable[torch.dtype]) -> list[Case]:
    rng = np.random.default_rng(0)
    cases = []
    for dtype in dtypes:
        tag = str(dtype).removeprefix("torch.")
        for case in update_cases(dtype, rng) + merge_cases(dtype, rng):
            cases.append(case._replace(name=f"{case.name} [{tag}]"))
    return cases


def extra_cases() -> list[Case]:
    path = Path(__file__).with_name("bench_gather_cases.py")
    if not path.exists():
        return []
    spec = importlib.util.spec_from_file_location("bench_gather_cases", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [Case(*case) for case in module.gather_cases()]


def measure(op: Callable[[], Any], copy: Callable[[], Any], budget_s: float) -> tuple[float, float]:
    """Median microseconds of ``op`` and ``copy``, timed alternately so load drifts hit both."""
    for _ in range(3):
        op(), copy()
    start = time.perf_counter()
    op(), copy()
    per_pair = time.perf_counter() - start
    repeats = int(min(2000, max(15, budget_s / max(per_pair, 1e-7))))
    op_t, copy_t = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        op()
        t1 = time.perf_counter()
        copy()
        t2 = time.perf_counter()
        op_t.append(t1 - t0)
        copy_t.append(t2 - t1)
    return statistics.median(op_t) * 1e6, statistics.median(copy_t) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fp32 only, shorter timing")
    parser.add_argument("--default-malloc", action="store_true", help="keep glibc's default trimming of freed memory")
    args = parser.parse_args()
    if not args.default_malloc:
        keep_freed_host_memory()
    torch.set_num_threads(1)
    dtypes = [torch.float32] if args.quick else [torch.float32, torch.bfloat16]
    budget = 0.2 if args.quick else 1.0
    # Inputs are built and ops run under inference mode, as in the runner's step.
    with torch.inference_mode():
        cases = cache_cases(dtypes) + extra_cases()
        width = max(len(c.name) for c in cases)
        print(f"{'case':<{width}} | {'op us':>10} | {'copy us':>10} | {'ratio':>6}")
        print(f"{'-' * width}-|-{'-' * 10}-|-{'-' * 10}-|-{'-' * 6}")
        for case in cases:
            op_us, copy_us = measure(case.op, case.copy, budget)
            print(f"{case.name:<{width}} | {op_us:>10.1f} | {copy_us:>10.1f} | {op_us / copy_us:>6.2f}")


if __name__ == "__main__":
    main()
