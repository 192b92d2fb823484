"""Speculative decoding, scheduler side: how many drafts each request gets, so speculation pays.

A verified draft costs one more token in the step's forward whether it is
accepted or not, so drafting pays only while the tokens the drafts are
expected to add outweigh what they add to the step's time.

Model (plain arithmetic, deterministic given the cost curve):

- Acceptance: draft ``j`` of a run is kept with probability ``a`` given
  that drafts ``1..j-1`` were (a geometric run), so it is worth ``a**j``
  expected tokens. ``a`` is estimated per request from decayed counts of
  kept drafts and of rejections (a run whose drafts were all kept shows no
  rejection: it was cut by ``k``, not by the model).
- Cost: ``StepCost``, the time of a step over ``T`` tokens relative to a
  one-token decode step, piecewise linear through measured points, with
  its own curve for plain decode steps. A speculating engine measures
  both on its machine when it starts (``worker/step_costs.py``; the
  scheduler itself never times anything); the built-in default is the
  embedded model's on an AVX-512 CPU, where a step of 3+ tokens costs
  about three decode steps.
- Each step the ``B`` decoding requests' draft values ``a_i**j`` are
  sorted, and the step drafts the ``m`` best of them for the ``m`` that
  maximizes expected tokens per unit time ``(B + sum of the m values) /
  cost(B + m)``; no drafts unless that beats plain decoding,
  ``B / cost.decode(B)``, by ``min_gain``. So a low-acceptance request stops drafting, a copying one
  drafts up to ``k``, and at a larger batch drafts must be better to pay.

Acceptance is measured in the shadow (``shadow`` / ``observe_tokens``):
each proposal, whole, whether none, some or all of it is verified, is
compared with the tokens the target then emits, one by one (one proposal
at a time per request), each match counted as it is seen, so a request
that starts copying drafts a few tokens later, not a whole proposal's
length of one-token steps later. For greedy requests that is exactly what
verification keeps; for sampled ones it has the same expectation (a draft
``d`` is kept with probability ``p(d)``, and the sampled token is ``d``
with probability ``p(d)``). So a request that stopped drafting notices at
no cost when its text starts copying again, open-ended text pays nothing
for being watched, and a run verified short of its proposal still counts
the rest (a copying request reaches full-length runs after one proposal).
The n-gram proposer is plain Python over the request's tokens, so its
shadow is free. A drafter whose proposals cost a forward (EAGLE) is
not free to watch: ``observe`` takes each verified run, and a request the
allocation leaves at zero drafts is probed (``drafter_drafts``): one
full-``k`` proposal first, then a one-draft one after 8, 16, ... up to 64
idle sampling steps (exponential back-off, reset once the allocation
drafts again), so a request whose text turns predictable is noticed. A
probe's proposal is scored in the shadow, like a prompt-lookup proposal,
never verified: it costs the head's passes but no verify step (on a 2-core
CPU a batch-8 step with one draft per row costs 1.5x a decode step, with
four 2.9x), so a head that never agrees costs one head pass every 64 tokens
at most.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise

# (tokens in the step, its time / a one-token decode step's), measured by
# benchmarks/bench_spec.py on the embedded default model (CPU, fp32, lean
# decoder, native int8 kernels, a loaded 2-core machine, so rounded): at
# batch 1, 2 rows stay on the kernels' small-row paths and 3+ rows cost
# about 2-3 decode steps; from T = 9 on, the slope keeps the ratios a batch
# of 8 measured (8 drafts 1.47x its decode step, 64 drafts 4.1x). Only
# ratios cost(B + m) / cost(B) matter. Overridable per engine (``DraftPolicy(step_cost=...)``).
DEFAULT_STEP_COST_POINTS = ((1, 1.0), (2, 1.3), (3, 2.2), (9, 3.3), (16, 4.8), (72, 13.3))
# Drafting must promise this much more tokens per unit time than plain decoding.
# Set when a verify step still left the decode fast path (the dense KV view was
# rebuilt after it, which the curve did not see: at 1.05, bench_spec measured
# open-ended chat at 0.79x at batch 1 and copy prompts at 0.80x at batch 8).
# Verify steps now continue the view; on a 2-core Zen 4, 1.15 and 1.3 measured
# the same within noise (four interleaved bench_spec runs each), so it stays.
DEFAULT_MIN_GAIN = 1.3
# Decay of the acceptance counts per observed draft run: about the last ten
# runs count, so a request that moves from copying to free text adapts in a
# few steps.
DEFAULT_DECAY = 0.8
# Prior counts: an unseen request starts at a = 0.5 (drafts worth trying at
# batch 1 and at moderate batches) with the weight of two runs.
PRIOR_ACCEPTED = 1.0
PRIOR_REJECTED = 1.0
# A drafter's probes of a request that stopped drafting: the first idle gap
# (in sampling steps) and the longest one (each failed probe doubles it). At 8
# a head that never agrees is probed 3 times in a 96-token reply after its first
# proposal (4 times at 4): each probe costs about a decode step at batch 1.
PROBE_FIRST_GAP = 8
PROBE_MAX_GAP = 64


@dataclass
class DraftState:
    """One request's acceptance record (lives on the ``Request``, freed with it)."""

    accepted: float = PRIOR_ACCEPTED  # decayed count of kept drafts
    rejected: float = PRIOR_REJECTED  # decayed count of rejections
    shadow: list[int] = field(default_factory=list)  # unverified proposal being scored
    shadow_matched: int = 0  # its tokens matched so far
    num_runs: int = 0  # draft runs observed, verified or in the shadow
    probe_wait: int = 0  # drafter only: idle sampling steps left before the next probe (0: probe now)
    probe_gap: int = PROBE_FIRST_GAP  # drafter only: the idle gap after the next probe
    probing: bool = False  # drafter only: the proposal asked for last is a probe (shadow-scored)

    @property
    def acceptance(self) -> float:
        """Estimated probability that a draft is kept given its predecessors were."""
        return self.accepted / (self.accepted + self.rejected)


class StepCost:
    """Relative time of a step over ``T`` tokens: piecewise linear through ``points``
    (``(T, cost)`` pairs, increasing ``T``), extended linearly past the last one.

    ``decode_points``, where given, price the steps that verify nothing (``T``
    one-token rows) on their own curve: such a step continues the decode fast
    path that a verify step leaves, so at the same ``T`` it can cost less.
    Without them both kinds of step share ``points``."""

    def __init__(
        self, points: Sequence[tuple[int, float]], decode_points: Sequence[tuple[int, float]] | None = None
    ) -> None:
        self.points = _curve(points)
        self.decode_points = _curve(decode_points) if decode_points is not None else self.points
        # Every step asks for the same few token counts: each is interpolated once.
        self._verify: dict[int, float] = {}
        self._decode: dict[int, float] = {}

    @classmethod
    def linear(cls, token_cost: float) -> StepCost:
        """``(1 + c * T) / (1 + c)``: a fixed cost per step plus ``c`` of it per token."""
        return cls(((1, 1.0), (2, (1 + 2 * token_cost) / (1 + token_cost))))

    def __call__(self, num_tokens: int) -> float:
        """A step of ``num_tokens`` tokens, some of them drafts."""
        cost = self._verify.get(num_tokens)
        if cost is None:
            cost = self._verify[num_tokens] = _interpolate(self.points, num_tokens)
        return cost

    def decode(self, num_rows: int) -> float:
        """A step of ``num_rows`` one-token decode rows."""
        cost = self._decode.get(num_rows)
        if cost is None:
            cost = self._decode[num_rows] = _interpolate(self.decode_points, num_rows)
        return cost


def _curve(points: Sequence[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    if len(points) < 2 or any(b[0] <= a[0] for a, b in pairwise(points)):
        raise ValueError(f"StepCost: expected two or more (tokens, cost) points with increasing tokens, got {points}")
    return tuple((int(t), float(c)) for t, c in points)


def _interpolate(points: tuple[tuple[int, float], ...], num_tokens: int) -> float:
    for (t0, c0), (t1, c1) in pairwise(points):
        if num_tokens <= t1 or (t1, c1) == points[-1]:
            return c0 + (c1 - c0) * (num_tokens - t0) / (t1 - t0)
    raise AssertionError("unreachable")


class DraftPolicy:
    """Chooses each request's number of drafts for a step (see the module docstring)."""

    def __init__(
        self,
        max_k: int,
        step_cost: StepCost | None = None,
        decay: float = DEFAULT_DECAY,
        min_gain: float | None = None,
    ) -> None:
        self.max_k = max_k
        self.step_cost = step_cost if step_cost is not None else StepCost(DEFAULT_STEP_COST_POINTS)
        self.decay = decay
        self.min_gain = DEFAULT_MIN_GAIN if min_gain is None else min_gain

    def allocate(self, states: Sequence[DraftState], caps: Sequence[int]) -> list[int]:
        """Drafts for each of a step's decoding requests (``caps[i]``: at most that many for request ``i``)."""
        num = len(states)
        values = sorted(
            ((state.acceptance**j, i) for i, (state, cap) in enumerate(zip(states, caps))
             for j in range(1, min(cap, self.max_k) + 1)),
            key=lambda v: -v[0],
        )  # fmt: skip
        cost = self.step_cost
        best_m, best_rate = 0, num / cost.decode(num) * self.min_gain
        tokens = float(num)
        for m, (value, _) in enumerate(values, 1):
            tokens += value
            rate = tokens / cost(num + m)
            if rate > best_rate:
                best_m, best_rate = m, rate
        out = [0] * num
        for _, i in values[:best_m]:
            out[i] += 1
        return out

    def num_drafts(self, state: DraftState, batch_size: int = 1) -> int:
        """Drafts worth verifying for one request in a step of ``batch_size`` like it."""
        return self.allocate([state] * batch_size, [self.max_k] * batch_size)[0]

    def drafter_drafts(self, state: DraftState, allocated: int) -> int:
        """Drafts a costly drafter proposes for a request the allocation gave
        ``allocated``: that many, or a probe when it is zero and one is due
        (``max_k`` before any run, then one draft; ``state.probing`` says which,
        for the scheduler to shadow-score a probe's proposal instead of verifying
        it); one call per sampling step, deterministic."""
        state.probing = False
        if allocated > 0:
            state.probe_wait, state.probe_gap = PROBE_FIRST_GAP, PROBE_FIRST_GAP
            return allocated
        if state.probe_wait > 0 or state.shadow:  # not due, or the last probe is still being scored
            state.probe_wait = max(state.probe_wait - 1, 0)
            return 0
        state.probing = True
        first = state.num_runs == 0
        state.probe_wait, state.probe_gap = state.probe_gap, min(2 * state.probe_gap, PROBE_MAX_GAP)
        # The first proposal is scored at full length; later probes propose one draft (each
        # further one costs a head step and an LM-head pass), enough to notice agreement and
        # raise the estimate.
        return self.max_k if first else 1

    def observe(self, state: DraftState, num_drafts: int, num_accepted: int) -> None:
        """A verified run: ``num_accepted`` of ``num_drafts`` drafts kept."""
        self._record(state, num_accepted, num_accepted < num_drafts)

    def shadow(self, state: DraftState, proposal: list[int]) -> None:
        """Score ``proposal`` (not verified) against the tokens that follow, unless one is pending."""
        if not state.shadow and proposal:
            state.shadow, state.shadow_matched = list(proposal), 0
            self._decay(state)  # the run's evidence counts as it comes in (``observe_tokens``)

    def observe_tokens(self, state: DraftState, tokens: list[int]) -> None:
        """Tokens the request just emitted (after its verified drafts, if any): they score the shadow.

        Each matching token counts as a kept draft at once, not when the run ends:
        a request that starts copying is priced up a token at a time, so it drafts
        a few steps after its first match instead of after a whole proposal's
        length of one-token steps."""
        if not state.shadow:
            return
        for t in tokens:
            matched = t == state.shadow[state.shadow_matched]
            state.accepted += matched
            state.rejected += not matched
            state.shadow_matched += matched
            if not matched or state.shadow_matched == len(state.shadow):  # the run is over
                state.shadow, state.num_runs = [], state.num_runs + 1
                return

    def _record(self, state: DraftState, kept: int, rejected: bool) -> None:
        self._decay(state)
        state.accepted += kept
        state.rejected += 1.0 if rejected else 0.0
        state.num_runs += 1

    def _decay(self, state: DraftState) -> None:
        state.accepted *= self.decay
        state.rejected *= self.decay
