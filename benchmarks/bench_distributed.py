"""Omnistage beyond one process, on Ray: side by side in one run.

Sections (``--sections``, default all), each in its own functions so that
more can join:

- ``routing``: data-parallel replicas (``data_parallel_size=2``), prefix-aware
  routing against round robin on a multi-turn image chat. Several
  conversations run at once; each turn resends the whole conversation (as a
  chat client does), so the replica that served turn k holds turn k+1's
  prefix: the image's KV included, so a hit skips the vision tower too.
  Round robin sends a turn to whichever replica is next (the conversations'
  order is shuffled every wave, as arrivals would be). Reported per policy:
  the prefix-cache hit rate and the time to first token (median and p90 over
  the run's requests), each the median of ``--repeat`` runs with their
  spread; the two policies alternate on the same replicas (ABBA order), each
  run on fresh images, so load from other processes hits both alike.

The checkpoint is the tiny Qwen2.5-VL of ``bench_mm.py`` whose vision tower
dominates. Each replica is a Ray actor with one CPU (one torch thread).

Run: ``python benchmarks/bench_distributed.py`` (``--quick`` for a smaller run).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_mm import make_image, user, write_checkpoint  # noqa: E402  (the VL checkpoint whose vision tower dominates)

from omnistage.engine.arg_utils import EngineArgs  # noqa: E402
from omnistage.sampling_params import SamplingParams  # noqa: E402


def load_line() -> str:
    with open("/proc/loadavg") as f:
        return "load average " + " ".join(f.read().split()[:3]) + f" on {os.cpu_count()} CPUs"


def spread(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:7.1f} ms [{min(values) * 1e3:.1f}..{max(values) * 1e3:.1f}]"


# ---------------------------------------------------------------- routing


@dataclass
class RoutingRun:
    policy: str
    hit_rate: float
    ttft_median: float
    ttft_p90: float
    wall: float


def run_wave(engine, prompts: dict[str, dict], params: SamplingParams) -> tuple[dict[str, float], dict[str, str]]:
    """Add every prompt, step until all finish; (TTFT per request, answer text per request)."""
    start: dict[str, float] = {}
    for rid, prompt in prompts.items():
        start[rid] = time.perf_counter()
        engine.add_request(rid, prompt, params)
    first: dict[str, float] = {}
    answers: dict[str, str] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id not in first and out.outputs[0].token_ids:
                first[out.request_id] = time.perf_counter() - start[out.request_id]
            if out.finished:
                if out.error is not None:
                    raise RuntimeError(out.error)
                answers[out.request_id] = out.outputs[0].text
    return first, answers


def run_conversations(engine, policy: str, tag: str, n_conv: int, n_turns: int, size: int) -> RoutingRun:
    """``n_conv`` image chats of ``n_turns`` turns, one wave per turn, under ``policy``."""
    engine.router.policy = policy
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    rng = random.Random(tag)
    images = [make_image(zlib.crc32(f"{tag}-{c}".encode()), size) for c in range(n_conv)]
    histories = [[user(f"conversation {tag}-{c}: what is in this picture?", images[c])] for c in range(n_conv)]
    before = engine.get_stats()
    ttfts: list[float] = []
    t0 = time.perf_counter()
    for turn in range(n_turns):
        order = list(range(n_conv))
        rng.shuffle(order)
        prompts = {f"{tag}-{c}-{turn}": engine.encode_chat(histories[c]) for c in order}
        first, answers = run_wave(engine, prompts, params)
        ttfts += first.values()
        for c in order:
            histories[c] += [{"role": "assistant", "content": answers[f"{tag}-{c}-{turn}"]},
                             user(f"follow-up {turn}: and what colour is it?")]  # fmt: skip
    wall = time.perf_counter() - t0
    after = engine.get_stats()
    queries = after.prefix_cache_query_tokens - before.prefix_cache_query_tokens
    hits = after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens
    ttfts.sort()
    p90 = ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))]
    return RoutingRun(policy, hits / queries if queries else 0.0, statistics.median(ttfts), p90, wall)


def bench_routing(path: str, repeat: int, n_conv: int, n_turns: int, size: int) -> dict[str, float]:
    from omnistage.engine.factory import build_engine

    engine = build_engine(EngineArgs(model=path, data_parallel_size=2, num_kv_blocks=4096, max_num_seqs=16))
    try:
        run_conversations(engine, "prefix", "warmup", 2, 2, size)  # actors' first-touch, lazy init
        runs: dict[str, list[RoutingRun]] = {"prefix": [], "round_robin": []}
        for r in range(repeat):
            order = ["prefix", "round_robin"] if r % 2 == 0 else ["round_robin", "prefix"]
            for policy in order:
                run = run_conversations(engine, policy, f"r{r}-{policy}", n_conv, n_turns, size)
                runs[policy].append(run)
        first_turn = engine.encode_chat([user("q", make_image(0, size))])
        prompt_tokens = len(engine.process_inputs("x", first_turn).prompt_token_ids)
    finally:
        engine.shutdown()
    print(f"[routing] 2 replicas, {n_conv} conversations x {n_turns} turns, {size}x{size} image in turn 1 "
          f"({prompt_tokens} prompt tokens), 8 tokens per answer; median [min..max] of {repeat} runs")  # fmt: skip
    summary = {}
    for policy, rs in runs.items():
        hit = statistics.median(r.hit_rate for r in rs)
        print(f"    {policy:12s} hit rate {hit:6.1%}  TTFT median {spread([r.ttft_median for r in rs])}"
              f"  p90 {spread([r.ttft_p90 for r in rs])}  run {spread([r.wall for r in rs])}")  # fmt: skip
        summary[policy + "_hit_rate"] = hit
        summary[policy + "_ttft"] = statistics.median(r.ttft_median for r in rs)
        summary[policy + "_wall"] = statistics.median(r.wall for r in rs)
    print(f"    prefix / round robin: TTFT median {summary['prefix_ttft'] / summary['round_robin_ttft']:.3f}, "
          f"run time {summary['prefix_wall'] / summary['round_robin_wall']:.3f}, "
          f"hit rate {summary['prefix_hit_rate']:.1%} vs {summary['round_robin_hit_rate']:.1%}")  # fmt: skip
    return summary


def section_routing(args: argparse.Namespace, path: str) -> None:
    if args.quick:
        bench_routing(path, repeat=2, n_conv=4, n_turns=3, size=224)
    else:
        bench_routing(path, repeat=4, n_conv=6, n_turns=4, size=336)


SECTIONS: dict[str, Callable[[argparse.Namespace, str], None]] = {"routing": section_routing}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller run")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {list(SECTIONS)}")
    args = parser.parse_args()
    import ray

    ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, log_to_driver=False)
    print(f"before: {load_line()}")
    with tempfile.TemporaryDirectory() as tmp:
        path = write_checkpoint(os.path.join(tmp, "vl"))
        for name in args.sections.split(","):
            SECTIONS[name](args, path)
    print(f"after:  {load_line()}")


if __name__ == "__main__":
    main()
