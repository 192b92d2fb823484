"""Sampled decoding against greedy, and the sampler against its textbook form, on the embedded default (CPU).

A sampled step applies temperature, top-k / top-p and min-p to every row's
logits and draws a token; a greedy one takes the argmax. Over SmolLM2's
49,152-token vocabulary the textbook top-p (sort the whole row) and draw (an
exponential race: a random number per token) cost more than a decode step
on a 2-core CPU. omnistage's sampler finds the nucleus in a partial top-k and
draws with one uniform per row (``worker/sampler.py``). This script runs the
same prompts with four engines' worth of settings, in turn, repeated:

- greedy;
- sampled (temperature 0.8, top-p 0.95), the shipped sampler;
- sampled, the textbook sampler (a full sort per row, an exponential race),
  patched in for its turns only;
- seeded sampled, the shipped sampler.

It prints decode tokens/s (bench_spec's definition) with medians and spreads
over the repeats, the ratios to greedy, and the shipped sampler over the
textbook one, at batch 1 and 8; ``uptime`` load before and after.

Run: ``python benchmarks/bench_sampling.py`` (``--repeat N``, ``--max-tokens N``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_spec import prompts_for, run  # noqa: E402 (the same prompts and decode tokens/s)

from omnistage.engine.arg_utils import EngineArgs  # noqa: E402
from omnistage.engine.stage_engine import LLMEngine  # noqa: E402
from omnistage.models.loader import load_model  # noqa: E402
from omnistage.sampling_params import SamplingParams  # noqa: E402
from omnistage.testing.textbook_sampling import textbook_sample_random, textbook_top_k_top_p  # noqa: E402
from omnistage.worker import sampler  # noqa: E402


class Textbook:
    """The textbook sampler patched into the sampler module while in use."""

    def __enter__(self) -> None:
        self._saved = sampler.apply_top_k_top_p, sampler.Sampler._sample_random
        sampler.apply_top_k_top_p = textbook_top_k_top_p
        sampler.Sampler._sample_random = staticmethod(textbook_sample_random)

    def __exit__(self, *exc: object) -> None:
        sampler.apply_top_k_top_p, random = self._saved
        sampler.Sampler._sample_random = staticmethod(random)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3, help="rounds of the four settings (default 3)")
    ap.add_argument("--max-tokens", type=int, default=64, help="new tokens per request (default 64)")
    args = ap.parse_args()
    load_before = os.getloadavg()
    loaded = load_model(None)
    engine = LLMEngine(EngineArgs(), loaded_model=loaded)
    n = args.max_tokens
    settings = {
        "greedy": (SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), False),
        "sampled": (SamplingParams(temperature=0.8, top_p=0.95, max_tokens=n, ignore_eos=True), False),
        "sampled, textbook": (SamplingParams(temperature=0.8, top_p=0.95, max_tokens=n, ignore_eos=True), True),
        "seeded": (SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=n, ignore_eos=True), False),
    }
    run(engine, prompts_for(engine, "chat", 2, 99), settings["greedy"][0], "warm")
    rates: dict[tuple[int, str], list[float]] = {}
    for batch in (1, 8):
        for r in range(args.repeat):
            names = list(settings)
            for name in names[r % len(names) :] + names[: r % len(names)]:  # who goes first rotates
                params, textbook = settings[name]
                prompts = prompts_for(engine, "chat", batch, r)
                if textbook:
                    with Textbook():
                        tps, _ = run(engine, prompts, params, f"{name}{batch}-{r}")
                else:
                    tps, _ = run(engine, prompts, params, f"{name}{batch}-{r}")
                rates.setdefault((batch, name), []).append(tps)
    load_after = os.getloadavg()
    print(f"\nsampled vs greedy decoding, {loaded.name}, {torch.get_num_threads()} threads, {n} new tokens, "
          f"{args.repeat} rounds; load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")  # fmt: skip
    print(f"{'batch':<7}{'setting':<20}{'tok/s':>9}{'spread':>16}{'/ greedy':>10}")
    for (batch, name), values in rates.items():
        greedy = statistics.median(rates[batch, "greedy"])
        med = statistics.median(values)
        print(f"{batch:<7}{name:<20}{med:>9.1f}{f'{min(values):.1f}..{max(values):.1f}':>16}{med / greedy:>9.2f}x")
    for batch in (1, 8):
        pairs = [a / b for a, b in zip(rates[batch, "sampled"], rates[batch, "sampled, textbook"])]
        print(f"batch {batch}: shipped sampler / textbook {statistics.median(pairs):.2f}x "
              f"({min(pairs):.2f}..{max(pairs):.2f}, per round)")  # fmt: skip


if __name__ == "__main__":
    main()
