"""Qwen3-Omni's code2wav stage: a step's chunks in one padded forward vs one forward per chunk.

The chunked stage hands the vocoder every request's ready chunk of a step
(``decode_scheduled``). Qwen3-Omni's causal code2wav decodes them in one
right-padded forward (``decode_chunks``); the loop it replaces calls
``decode_chunk`` once per request. This script builds the step a stage sees
with ``B`` concurrent streamed requests (each at a different point of its
stream: first chunks of 4 frames, later ones of 12 with 21 frames of left
context, a last one of odd length) and times both ways on the tiny
checkpoint, interleaved, repeated; median [range] of CPU seconds per step
(``time.thread_time``, one torch thread) and the loop / batched ratio, with
the load average before and after. It also checks the outputs agree (max abs
difference). Tiny weights: per-call overhead dominates, so the ratio says
little about the published model's.

    PYTHONPATH=. python benchmarks/bench_code2wav_batch.py [--rounds 7] [--batches 2,4,8]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np
import torch

from omnistage.core.chunk_schedule import ChunkSchedule
from omnistage.models.chunked_vocoder import ChunkCall
from omnistage.models.qwen3_omni import load_qwen3_omni
from omnistage.testing.tiny_qwen3_omni_checkpoint import write_tiny_qwen3_omni


def step_calls(batch: int, q: int, seed: int) -> list[ChunkCall]:
    """``batch`` requests' chunks as one step schedules them (varied indices and lengths)."""
    schedule = ChunkSchedule(first=4, size=12)
    rng = np.random.default_rng(seed)
    calls = []
    for b in range(batch):
        index = b % 4  # chunk 0 (4 frames), 1, 2, 3 (12 frames each, after left context)
        known = 4 + 12 * index
        last = b % 3 == 2
        if last:
            known -= 5  # an odd-length last chunk
        codes = rng.integers(0, 64, (known, q)).tolist()
        calls.append(ChunkCall(codes, index, schedule, last))
    return calls


def _uptime() -> str:
    try:
        with open("/proc/loadavg") as f:
            return "loadavg " + " ".join(f.read().split()[:3])
    except OSError:
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batches", default="2,4,8")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        vocoder = load_qwen3_omni(write_tiny_qwen3_omni(tmp)).code2wav
    print(f"start: {_uptime()}")
    print(f"{'B':>3} {'loop s/step':>26} {'batched s/step':>26} {'loop/batched':>13} {'max |diff|':>11}")
    for batch in (int(b) for b in args.batches.split(",")):
        calls = step_calls(batch, vocoder.num_quantizers, seed=batch)
        ways = {
            "loop": lambda: [vocoder.decode_chunk(c.codes, c.index, c.state, c.last) for c in calls],
            "batched": lambda: vocoder.decode_chunks(calls),
        }
        times: dict[str, list[float]] = {k: [] for k in ways}
        outs = {k: f() for k, f in ways.items()}  # warm-up, and the outputs to compare
        for r in range(args.rounds):
            for name in ways if r % 2 == 0 else reversed(list(ways)):
                t0 = time.thread_time()
                ways[name]()
                times[name].append(time.thread_time() - t0)
        diff = max(float(np.abs(a - b).max()) if a.size else 0.0 for a, b in zip(outs["loop"], outs["batched"]))
        med = {k: statistics.median(v) for k, v in times.items()}
        cell = {k: f"{med[k]:.4f} [{min(v):.4f}, {max(v):.4f}]" for k, v in times.items()}
        print(f"{batch:>3} {cell['loop']:>26} {cell['batched']:>26} {med['loop'] / med['batched']:>13.2f} {diff:>11.1e}")
    print(f"end: {_uptime()}")


if __name__ == "__main__":
    main()
