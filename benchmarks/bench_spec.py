"""Prompt-lookup speculative decoding against speculation off, on the embedded default model (CPU).

One process, one run, the same loaded weights for both engines (greedy, so
both emit the same tokens, which is checked):

1. copy-heavy prompts (rewrite a JSON object with one field changed, fix
   the typos in a paragraph, extract the sentences that mention a word,
   fix the bug in a function): decode tokens/s with ``ngram`` vs off,
   batch 1 and batch 8 (targets 1.5x and 1.2x). A batch of 8 runs until
   its last request ends, so its time is at least that request's steps:
   where the model's answer leaves the text it copies every few tokens
   (the typos) or stops copying (the note after the fixed function), that
   request gains little, and every draft its neighbours verify lengthens
   its steps. So each copy task is also run alone at batch 8
   (``copy:<task>``, no target), to show which tasks copy and how far a
   batch that copies throughout goes. Beside each
   prompt-lookup row, its ceiling, measured: a third engine runs the same
   prompts side by side with the other two, and each of its steps verifies
   exactly the prompt-lookup drafts the model then emits, never a rejected
   one (the outputs known from a run of the same prompts on a separate
   engine). It is what knowing which drafts will be kept would win
   (``ceiling``);
2. open-ended chat prompts at batch 1 and 8 (target 0.97x: never a slowdown),
   with ``ngram`` and with ``eagle`` and a random head (written here with the
   model's width: it agrees with the model almost never, so the row shows
   what the draft policy's probes with back-off cost: each a head pass over
   the positions it skipped since the last one and an LM-head row, scored in
   the shadow, never verified; once the first request has walked the
   back-off, the next ones are probed at once and then every 64 steps; the
   head is in Q8_0, since the target is a Q4_1 GGUF; target 0.97x);
3. the cost of a step that verifies ``k`` drafts relative to a one-token
   decode step, ``k = 1..8``, at batch 1 and 8 (drafts forced to a token
   the model will not emit, so every step emits one token): it sets what
   speculation can win here. Beside it, the same ratios from the curves the
   speculating engine measured when it started, which its draft policy
   prices drafts by (``worker/step_costs.py``; those leave the engine's own
   per-step Python out, so they read higher: about 10% at ``k = 8``).

Each row runs on new engines, warmed alike (an engine's history moved its
speed by a tenth here): off and spec, and for prompt lookup the ceiling's.
They run the same prompts side by side, a few engine steps of each in turn
(rotating which goes first), so a burst of load on a shared machine, which
here slows every step by a fifth for seconds at a time, hits them alike;
each measurement is repeated ``--repeat`` times (by default 3, and 5 for
the chat rows, whose 3% margin is about three pairs' spread). Ratios are
medians of the per-pair ratios, with their min..max spread; ``uptime`` load
is printed before and after. Decode tokens/s counts the tokens after each
request's first over the engine's own step time from the step that gave
the last first token to the last finish.

Run: ``python benchmarks/bench_spec.py`` (``--quick`` for a smaller run: its
32 tokens are mostly the draft policy's shadow warm-up, so the copy rows read
low there; the targets are for the full run; ``--threads 1`` on a loaded
shared machine; ``--only ngram/copy/8 --repeat 9`` for one row, about a
minute).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from omnistage.core.spec_decode import propose_ngram
from omnistage.engine.arg_utils import EngineArgs
from omnistage.engine.stage_engine import LLMEngine
from omnistage.models.loader import load_model
from omnistage.sampling_params import SamplingParams
from omnistage.testing.tiny_eagle import write_tiny_eagle_head

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 8,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
}
TARGETS = {("copy", 1): 1.5, ("copy", 8): 1.2, ("chat", 1): 0.97, ("chat", 8): 0.97}

_JSON = (
    '{"name": "Alice Martin", "age": 34, "city": "%s", "email": "alice.martin@example.com", '
    '"languages": ["English", "French"], "active": true, "team": "data platform"}'
)
_TYPOS = (
    "The quick brown fox jumpd over the lazzy dog. It was a beautifull morning and the sun was "
    "shinning brightly over the feilds. The farmer walked to the barn to feed the animls, and the "
    "chickens were already waiting for thier breakfast."
)
_STORY = (
    "Maria opened the bakery at six. The river was quiet that morning. Her brother Tom brought the "
    "flour from the mill. A storm had closed the river road last week. Customers asked about the river "
    "festival. Tom said the mill would close early. Maria baked extra bread for the festival."
)
# The function task: the 135M model copies this four-line function with its bug fixed.
# A six-line one with a loop it rewrote in its own words under every phrasing tried
# (renaming a variable, adding a line, a docstring or comments, fixing a misspelt name),
# copying little more than its first line.
_FUNC = 'def greet(name):\n    message = "Hello, " + name\n    print(mesage)\n    return message\n'
COPY_TASKS = {
    "json": lambda i: (
        f"Rewrite this JSON object with the city changed to Paris. Output only the JSON.\n{_JSON % ('Lyon' + str(i))}"
    ),
    "typos": lambda i: f"Fix the typos in this paragraph and output the corrected paragraph ({i}):\n{_TYPOS}",
    "extract": lambda i: f"Copy the sentences of this text that mention the river, one per line ({i}):\n{_STORY}",
    "function": lambda i: (
        f"Fix the bug in this function and output the whole corrected function ({i}):\n```python\n{_FUNC}```"
    ),
}
CHAT_TOPICS = [
    "the sea", "a lighthouse", "autumn leaves", "a robot", "the moon", "a small village", "coffee", "mountains",
]  # fmt: skip


def prompts_for(engine: LLMEngine, kind: str, batch: int, rep: int) -> list[dict]:
    """``batch`` chat prompts of a workload (``copy`` mixes the copy tasks, ``copy:<task>`` is one of
    them); each repetition asks slightly differently (no cross-run hits)."""
    workload, _, task = kind.partition(":")
    if workload == "copy":
        tasks = [COPY_TASKS[task]] if task else list(COPY_TASKS.values())
        texts = [tasks[(i + rep) % len(tasks)](rep * 16 + i) for i in range(batch)]
    else:
        texts = [
            f"Write a short story about {CHAT_TOPICS[(i + rep) % len(CHAT_TOPICS)]} (#{rep})." for i in range(batch)
        ]
    return [engine.encode_chat([{"role": "user", "content": t}]) for t in texts]


def run(engine: LLMEngine, prompts: list[dict], params: SamplingParams, tag: str) -> tuple[float, list]:
    """Decode tokens/s (see the module docstring) and the finished outputs in prompt order."""
    return run_side_by_side([engine], prompts, params, tag)[0]


# Steps each engine runs per turn side by side: a turn lasts a fraction of a second, a burst of
# load seconds. One-step turns would cost each engine the other's evictions from the CPU caches,
# which a lone engine never pays (an EAGLE engine read 1.5% slower that way).
STEPS_PER_TURN = 8


def run_side_by_side(
    engines: list[LLMEngine], prompts: list[dict], params: SamplingParams, tag: str
) -> list[tuple[float, list]]:
    """``prompts`` on each engine, ``STEPS_PER_TURN`` steps of each in turn: per engine, decode tokens/s
    over its own steps' time (see the module docstring) and its outputs in prompt order."""
    runs = []
    for e, engine in enumerate(engines):
        for i, p in enumerate(prompts):
            engine.add_request(f"{tag}-{e}-{i}", p, params)
        runs.append({"steps": [], "seen": set(), "outs": [], "first": 0, "last": 0})
    while any(engine.has_unfinished_requests() for engine in engines):
        for engine, r in zip(engines, runs):
            for _ in range(STEPS_PER_TURN):
                if not engine.has_unfinished_requests():
                    break
                start = time.perf_counter()
                outputs = engine.step()
                r["steps"].append(time.perf_counter() - start)
                new = {o.request_id for o in outputs} - r["seen"]
                if new:  # a request's first token: decode time starts after the last such step
                    r["seen"] |= new
                    r["first"] = len(r["steps"])
                done = [o for o in outputs if o.finished]
                if done:
                    r["outs"] += done
                    r["last"] = len(r["steps"])
    results = []
    for r in runs:
        outs = sorted(r["outs"], key=lambda o: int(o.request_id.rsplit("-", 1)[1]))
        tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
        results.append((tokens / max(sum(r["steps"][r["first"] : r["last"]]), 1e-9), outs))
    return results


def propose_what_is_kept(engine: LLMEngine, futures: list[list[int]]) -> None:
    """Make ``engine`` the ceiling's: each decode step proposes the ``NGRAM`` lookup cut at
    its first token the model does not then emit, so every draft verified is kept and
    every one that would be kept is verified. ``futures[i]``: prompt ``i``'s greedy output
    (request ids end in ``-i``, as :func:`run_side_by_side` names them)."""

    def propose(request, n):  # the step's budget cuts the drafts later, as the engine's own
        if n != 1 or request.num_computed_tokens != request.num_tokens - 1:
            return []
        future = futures[int(request.request_id.rsplit("-", 1)[1])][request.num_output_tokens :]
        k = min(NGRAM["num_speculative_tokens"], len(future) - 1)
        if k < 1:
            return []
        drafts, _ = propose_ngram(request.all_token_ids, k, NGRAM["prompt_lookup_min"], NGRAM["prompt_lookup_max"])
        return drafts[: next((j for j, t in enumerate(drafts) if t != future[j]), len(drafts))]

    engine.scheduler._propose = propose


def verify_cost(engine: LLMEngine, batch: int, steps: int, reps: int) -> list[float]:
    """Seconds per step with ``k`` forced drafts, ``k = 0..8``, medians over ``reps`` interleaved rounds."""
    sched = engine.scheduler
    forced = {"k": 0}

    def propose(request, n):  # every draft the token just emitted: (almost) always rejected
        if n != 1 or request.num_computed_tokens != request.num_tokens - 1 or not forced["k"]:
            return []
        return [request.all_token_ids[-1]] * forced["k"]

    sched._propose = propose
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    times: dict[int, list[float]] = {k: [] for k in range(9)}
    for r in range(reps):
        for k in range(9):
            forced["k"] = k
            prompts = [
                engine.encode_chat([{"role": "user", "content": f"Tell me about {t} ({r}, {k})."}])
                for t in CHAT_TOPICS[:batch]
            ]
            for i, p in enumerate(prompts):
                engine.add_request(f"cost{batch}-{r}-{k}-{i}", p, params)
            engine.step()  # prefill and first token
            t0, n = time.perf_counter(), 0
            while engine.has_unfinished_requests():
                engine.step()
                n += 1
            times[k].append((time.perf_counter() - t0) / n)
    del sched._propose
    return [statistics.median(times[k]) for k in range(9)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="32 new tokens, 2 repeats, a short cost sweep",
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=None,
        help="interleaved pairs per measurement (default 3 and 5 for the chat rows, quick 2)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: torch's)",
    )
    ap.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="new tokens per request (default 96, quick 32)",
    )
    ap.add_argument(
        "--only",
        action="append",
        default=None,
        metavar="METHOD/WORKLOAD/BATCH",
        help="run only this row (e.g. ngram/copy/8, ngram/copy:json/8, eagle-rand/chat/1); repeatable",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    reps = args.repeat or (2 if args.quick else 3)
    # The chat rows are judged by a 3% margin, about the spread of three pairs here (0.95..0.98 on one
    # row whose six pairs read 0.99): more pairs for them.
    chat_reps = args.repeat or (2 if args.quick else 5)
    new_tokens = args.max_tokens or (32 if args.quick else 96)
    load_before = os.getloadavg()

    loaded = load_model(None)
    scratch = tempfile.TemporaryDirectory(prefix="bench_spec_eagle_")  # removed when main returns
    head = write_tiny_eagle_head(loaded.model_path, Path(scratch.name) / "head")
    eagle_cfg = {"method": "eagle", "model": str(head), "num_speculative_tokens": 4}
    configs = {"ngram": NGRAM, "eagle-rand": eagle_cfg}
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens)

    def fresh(spec_config: dict | None = None) -> LLMEngine:
        """A warmed engine on the loaded weights. Each row's engines start equal: an engine that
        had run the copy rows decoded chat a tenth faster than a new one here, which read the
        random-head row (its engine new at batch 8) at 0.80x, run first at 0.96x."""
        engine = LLMEngine(EngineArgs(speculative_config=spec_config), loaded_model=loaded)
        warm = [engine.encode_chat([{"role": "user", "content": f"Say hi #{i}"}]) for i in range(2)]
        run(engine, warm, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), "warm")
        return engine

    rows = []
    shapes = [(m, kind, b) for m, kind in (("ngram", "copy"), ("ngram", "chat"), ("eagle-rand", "chat")) for b in (1, 8)]
    shapes[2:2] = [("ngram", f"copy:{task}", 8) for task in COPY_TASKS]  # what bounds the mixed batch
    if args.only:
        known = {f"{m}/{k}/{b}": (m, k, b) for m, k, b in shapes}
        unknown = [row for row in args.only if row not in known]
        if unknown:
            ap.error(f"--only {unknown[0]!r} is no row; the rows are {', '.join(known)}")
        shapes = [known[row] for row in args.only]
    recorder = fresh()  # the ceiling's futures: each prompt set's greedy outputs, before it is measured
    for method, kind, batch in shapes:
        engines = {"off": fresh(), "spec": fresh(configs[method])}
        if method == "ngram":
            engines["ceiling"] = fresh(NGRAM)
        tps = {name: [] for name in engines}
        ratios, bounds, same, drafts, accepted, runs, tokens = [], [], True, 0, 0, 0, 0
        for r in range(chat_reps if kind == "chat" else reps):
            tag = f"{method}{kind}{batch}-{r}"
            prompts = prompts_for(recorder, kind, batch, r)
            if "ceiling" in engines:
                _, recorded = run(recorder, prompts, params, f"{tag}-rec")
                propose_what_is_kept(engines["ceiling"], [o.outputs[0].token_ids for o in recorded])
            names = list(engines)
            order = names[r % len(names) :] + names[: r % len(names)]  # who goes first rotates
            side = run_side_by_side([engines[name] for name in order], prompts, params, tag)
            got = {}
            for name, (rate, outs) in zip(order, side):
                tps[name].append(rate)
                got[name] = [o.outputs[0].token_ids for o in outs]
            ratios.append(tps["spec"][-1] / tps["off"][-1])
            if "ceiling" in engines:
                bounds.append(tps["ceiling"][-1] / tps["off"][-1])
            same &= all(ids == got["off"] for ids in got.values())
            for o in side[order.index("spec")][1]:
                m = o.metrics
                drafts, accepted, runs = (
                    drafts + m.num_draft_tokens,
                    accepted + m.num_accepted_tokens,
                    runs + m.num_drafts,
                )
                tokens += len(o.outputs[0].token_ids)
        rows.append((method, kind, batch, tps, ratios, bounds, same, drafts, accepted, runs, tokens))

    cost_steps, cost_reps = (6, 1) if args.quick else (12, 2)
    on = fresh(NGRAM)
    costs = {b: verify_cost(on, b, cost_steps, cost_reps) for b in (1, 8)}
    load_after = os.getloadavg()

    print(f"\nspeculative decoding vs off, {loaded.name}, {torch.get_num_threads()} threads, "
          f"{new_tokens} new tokens, {reps} interleaved pairs ({chat_reps} for chat); "
          f"ngram k_max={NGRAM['num_speculative_tokens']}, "
          f"eagle-rand (random head) k={eagle_cfg['num_speculative_tokens']}")  # fmt: skip
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} (1-min; {os.cpu_count()} CPUs)")
    head = f"{'method':<11}{'workload':<14}{'batch':>6}{'off tok/s':>11}{'spec tok/s':>13}{'ratio':>8}{'spread':>14}{'target':>8}  ok"
    print(head + f"{'ceiling':>9}{'accept':>8}{'mean len':>9}{'drafted/tok':>12}  same tokens")
    for method, kind, batch, tps, ratios, bounds, same, drafts, accepted, runs, tokens in rows:
        ratio = statistics.median(ratios)
        target = TARGETS.get((kind, batch))
        verdict = ("-", "") if target is None else (f">={target}", "yes" if ratio >= target else "NO")
        rate = f"{accepted / drafts:.2f}" if drafts else "-"
        mean_len = f"{1 + accepted / runs:.2f}" if runs else "-"
        bound = f"{statistics.median(bounds):.2f}x" if bounds else "-"
        print(
            f"{method:<11}{kind:<14}{batch:>6}{statistics.median(tps['off']):>11.1f}{statistics.median(tps['spec']):>13.1f}"
            f"{ratio:>7.2f}x{f'{min(ratios):.2f}..{max(ratios):.2f}':>14}{verdict[0]:>8}  "
            f"{verdict[1]:<3}{bound:>9}{rate:>8}{mean_len:>9}{drafts / max(tokens, 1):>12.2f}  {same}"
        )
    print("copy:<task>: eight requests of that one copy task (no target; they show what bounds the mixed batch)")
    print("ceiling: measured speed-up of an engine verifying exactly the drafts the model then emits (median)")
    print("accept = accepted / verified drafts; mean len = tokens emitted per verify run (1 + accepted / runs)")
    print("\nverify cost: step time with k drafts / a one-token decode step (medians), and what the")
    print("engine measured for the same steps when it started (worker/step_costs.py; its draft policy's prices)")
    cost = on.scheduler.draft_policy.step_cost
    print(f"{'batch':<7}{'':<9}" + "".join(f"{'k=' + str(k):>7}" for k in range(1, 9)) + f"{'1-step ms':>11}")
    for b, t in costs.items():
        rel = [t[k] / t[0] for k in range(1, 9)]
        print(f"{b:<7}{'here':<9}" + "".join(f"{r:>7.2f}" for r in rel) + f"{t[0] * 1000:>11.1f}")
        est = [cost.verify(b, b * k) / cost.decode(b) for k in range(1, 9)]
        print(f"{'':<7}{'engine':<9}" + "".join(f"{r:>7.2f}" for r in est))

if __name__ == "__main__":
    main()
