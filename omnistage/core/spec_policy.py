"""Speculative decoding, scheduler side: how many drafts each request gets, so speculation pays.

A verified draft costs one more token in the step's forward whether it is
accepted or not, so drafting pays only while the tokens the drafts are
expected to add outweigh what they add to the step's time.

Model (plain arithmetic, deterministic given the cost curve):

- Acceptance: a run of drafts stops at its first miss, so draft ``j`` is
  worth the chance that it and every draft before it are kept. Where a
  draft stands predicts that far better than one rate per request: the
  first draft after the text left its last proposal (a fresh lookup after
  an edit, a fixed typo, a new sentence) is a guess; a draft continuing a
  run the text is following is nearly sure. So each request keeps two
  rates, from decayed counts of its emitted tokens scored against the
  proposals that stood for them: ``start_rate`` for a token whose
  predecessor was not predicted, ``next_rate`` for one whose predecessor
  was (``in_run``). A proposal's first draft is worth the rate of where the
  request stands, each further one ``next_rate`` times the one before.
  (One rate mixes the two: text copied with an edit every few words reads
  about 0.8, which drafts one or two a step at batch 8 where an oracle
  verifies runs of eight.) Prompt lookup's drafts are known when the step
  is split, and a third rate, ``piece_rate``, prices those inside a word
  the tokenizer splits into pieces (a piece, or a token a piece follows;
  ``word_pieces``), wherever they stand: edits fall there (a misspelt word,
  a wrong name), so a request fixing typos learns that its split words are
  rewritten and its whole words copied, and drafts up to the next split
  word; one copying an e-mail address learns that its pieces copy too. On
  recorded outputs of the typo task, a proposal's first draft was kept 43%
  of the time inside a split word and 85% outside, its later ones 56% and
  89%. A fourth rate, ``copy_rate``, takes ``next_rate``'s place when
  prompt lookup's proposal copies the prompt (``propose_ngram`` says where
  its drafts start) rather than the request's own output: copying its input
  is what prompt lookup is for, and such runs hold, where a reply repeating
  its own phrases soon breaks off. Replaying the lookup over recorded greedy
  outputs of bench_spec's prompts (24 of each kind), the copy tasks' drafts
  inside a run nearly all copied the prompt and were kept 90% of the time
  as a run's second token and 95% later, while open-ended chat's nearly
  all (243 of 250) repeated the reply and were kept 38% and 70%. With one
  in-run rate, chat's repeats priced the copies low, or a surer prior made
  chat draft its repeats at a loss; apart, each request learns each.
- Cost: ``StepCost``, relative to a one-token decode step: plain decode
  steps by their row count, and what drafts add to a step by how many
  rows it has (at one row the kernels' small-row paths make the first
  drafts dear; at eight a draft adds about a fifth of a one-row step,
  1/18 of the 8-row one). A speculating engine measures both on its
  machine when it starts (``worker/step_costs.py``; the scheduler itself
  never times anything); the built-in default is the embedded model's on
  an AVX-512 CPU.
- Each step the ``B`` decoding requests' draft values are sorted, and the
  step drafts the ``m`` best of them for the ``m`` that maximizes expected
  tokens per unit time ``(B + sum of the m values) / verify(B, m)``; no
  drafts unless that beats plain decoding, ``B / decode(B)``, by
  ``min_gain``. So a low-acceptance request stops drafting, a copying one
  drafts up to ``k``, and at a larger batch drafts must be better to pay.

Acceptance is measured in the shadow (``shadow`` / ``observe_tokens``):
each proposal, whole, whether none, some or all of it is verified, is
compared with the tokens the target then emits, one by one, until the next
proposal takes its place. Prompt lookup proposes every decode step, so
each step's proposal is scored against that step's tokens: its kept
drafts, and the token after them against the proposal's next. For greedy
requests that is exactly what verification keeps; for sampled ones it has
the same expectation (a draft ``d`` is kept with probability ``p(d)``, and
the sampled token is ``d`` with probability ``p(d)``). So a request that
stopped drafting notices at no cost when its text starts copying again,
open-ended text pays nothing for being watched, and a run verified short
of its proposal still counts the next token. The n-gram proposer is plain
Python over the request's tokens, so its shadow is free. A drafter whose
proposals cost a forward (EAGLE) is not free to watch: ``observe`` takes
each verified run, and a request the allocation leaves at zero drafts is
probed (``drafter_drafts``): a one-draft proposal at once, then after 8,
16, ... up to 64 idle sampling steps (exponential back-off, reset once the
allocation drafts again), so a request whose text turns predictable is
noticed; a probe kept whole is followed at once by a full-``k`` one, so an
agreeing head reaches the allocation's bar in a few steps, not after idle
gaps. The back-off is also the engine's: a probe waits at least as long
as the longest gap any request's probe has reached since a probe or a
verified run was last kept whole, by any request. So once a head has
failed a request through its back-off, the next requests are probed at
once (every request still is: a head may suit one text and not another)
and then only every 64 steps, instead of walking the back-off again each;
while the head agrees somewhere, each request walks its own from 8. A
probe's proposal is scored in the shadow across the steps that follow,
never verified: it costs the head's passes but no verify step (on a 2-core
CPU a batch-8 step with one draft per row costs 1.5x a decode step, with
four 2.9x), so a head that never agrees costs one head pass every 64
tokens at most.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise

# A step's time / a one-token decode step's, measured by benchmarks/bench_spec.py
# on the embedded default model (CPU, fp32, lean decoder, native int8 kernels,
# 2 cores, rounded). Verify steps, for steps of 1 row and of 8 rows: (tokens
# in the step, time); at 1 row 8 drafts cost about 3.3 decode steps, at 8 rows
# 8 drafts (one a row) 1.45x the 8-row decode step and 32 drafts 2.7x. Plain
# decode steps: (rows, time). Only ratios matter. Overridable per engine
# (``DraftPolicy(step_cost=...)``).
DEFAULT_VERIFY_COSTS = {
    1: ((1, 1.0), (2, 1.3), (3, 1.65), (4, 2.0), (6, 2.45), (9, 3.25)),
    8: ((8, 3.4), (16, 4.9), (24, 6.3), (40, 9.2)),
}
DEFAULT_DECODE_COSTS = ((1, 1.0), (2, 1.35), (3, 1.7), (8, 3.4))
# Drafting must promise this much more tokens per unit time than plain decoding:
# a margin for the estimates' noise. Replaying the policy over recorded bench_spec
# outputs with the engine's step costs (2-core Zen 4), the mixed copy batch of 8
# gained 1.18x at 1.1, 1.15x at 1.2 and 1.12x at 1.3; at 1.0 open-ended chat
# started drafting at batch 8 (0.99x).
DEFAULT_MIN_GAIN = 1.1
# Decay of a rate's counts per token it is scored on: about its last five count,
# so a request that moves from copying to free text adapts in a few tokens.
DEFAULT_DECAY = 0.8
# Prior counts (kept, missed), the weight of two tokens each: an unseen request's
# first draft is a guess (0.25), a draft continuing a run likely (0.75); on the
# recorded copy prompts, starting both at 0.5 drafted later and lost 3% at batch 8.
PRIOR_START = (0.5, 1.5)
PRIOR_NEXT = (1.5, 0.5)
# ... and for a draft inside a word the tokenizer splits into pieces (prompt lookup only):
# a coin toss until the request shows whether its edits fall there.
PRIOR_PIECE = (1.0, 1.0)
# ... and for a draft inside a run of a proposal that copies the prompt (prompt lookup only):
# nearly sure (0.95, the weight of two tokens). Side by side on the engine (ten rounds),
# the copy batch of 8 read 1.22x with it against 1.18x with one in-run rate for both
# sources, open-ended chat at batch 8 0.996x against 0.990x; (3.0, 0.1) and (6.0, 0.1)
# read 1.22x and 1.21x on the copies.
PRIOR_COPY = (2.0, 0.1)
# A drafter's probes of a request that stopped drafting: the first idle gap
# (in sampling steps) and the longest one (each failed probe doubles it). At 8
# a head that never agrees is probed 4 times in a 96-token reply (at once, then
# after 8, 16 and 32 idle steps), and twice (at once, then after 64) once the
# engine's back-off has reached 64: each probe costs a head pass over the
# positions since the last one and one LM-head row (on a 2-core CPU about 3 ms,
# two thirds of a decode step at batch 1).
PROBE_FIRST_GAP = 8
PROBE_MAX_GAP = 64


@dataclass
class DraftState:
    """One request's acceptance record (lives on the ``Request``, freed with it)."""

    start_kept: float = PRIOR_START[0]  # decayed counts of tokens scored while not in a run
    start_missed: float = PRIOR_START[1]
    next_kept: float = PRIOR_NEXT[0]  # ... and of tokens right after a predicted one (not copying the prompt)
    next_missed: float = PRIOR_NEXT[1]
    piece_kept: float = PRIOR_PIECE[0]  # ... and of tokens drafted inside a split word, wherever they stood
    piece_missed: float = PRIOR_PIECE[1]
    copy_kept: float = PRIOR_COPY[0]  # ... and of tokens in a run of a proposal that copies the prompt
    copy_missed: float = PRIOR_COPY[1]
    in_run: bool = False  # the request's last token was the one its proposal predicted
    shadow: list[int] = field(default_factory=list)  # the proposal being scored (verified or not)
    shadow_matched: int = 0  # its tokens matched so far
    from_prompt: bool = False  # it copies the prompt (prompt lookup), not the request's own output
    probe_wait: int = 0  # drafter only: idle sampling steps left before the next probe (0: probe now)
    probe_gap: int = PROBE_FIRST_GAP  # drafter only: the idle gap after the next probe
    probing: bool = False  # drafter only: the proposal asked for last is a probe (shadow-scored)
    probe_full: bool = False  # drafter only: the next probe proposes max_k drafts (else one)

    @classmethod
    def with_counts(cls, kept: float, missed: float) -> DraftState:
        """A record with one rate, ``kept / (kept + missed)``, wherever a draft stands."""
        return cls(
            kept, missed, kept, missed, piece_kept=kept, piece_missed=missed, copy_kept=kept, copy_missed=missed
        )

    @property
    def start_rate(self) -> float:
        """Estimated probability that a run's first draft is kept."""
        return self.start_kept / (self.start_kept + self.start_missed)

    @property
    def next_rate(self) -> float:
        """Estimated probability that a draft is kept given the token before it was predicted."""
        return self.next_kept / (self.next_kept + self.next_missed)

    @property
    def copy_rate(self) -> float:
        """Estimated probability that a draft copying the prompt is kept given the token before it was predicted."""
        return self.copy_kept / (self.copy_kept + self.copy_missed)

    @property
    def piece_rate(self) -> float:
        """Estimated probability that a draft inside a split word is kept."""
        return self.piece_kept / (self.piece_kept + self.piece_missed)


class StepCost:
    """Relative time of a step (a one-token decode step is 1).

    - ``decode(rows)``: a step of ``rows`` one-token rows, piecewise linear
      through ``decode_points`` (``(rows, cost)``, extended linearly past the
      last point).
    - ``verify(rows, drafts)``: the same rows verifying ``drafts`` drafts among
      them: ``decode(rows)`` plus what the drafts add. That extra is read off
      curves of steps measured at a few row counts (``verify_curves[R]``:
      ``(tokens in the step, cost)`` of steps of ``R`` rows, the first point at
      ``R`` tokens) as ``curve(R + drafts) - curve(R)``, linear in the row count
      between the measured ones and held past the ends. So a draft is priced by
      the rows it joins: one step's token count alone would price a draft
      joining 8 rows off a one-row step of 9 tokens.

    Without ``decode_points``, plain decode steps are priced on the first verify
    curve (as one-row steps over ``rows`` tokens)."""

    def __init__(
        self,
        verify_curves: Mapping[int, Sequence[tuple[int, float]]],
        decode_points: Sequence[tuple[int, float]] | None = None,
    ) -> None:
        self.verify_curves = {rows: _curve(verify_curves[rows]) for rows in sorted(verify_curves)}
        if not self.verify_curves or any(rows < 1 or c[0][0] != rows for rows, c in self.verify_curves.items()):
            raise ValueError(f"StepCost: each verify curve of R rows must start at R tokens, got {verify_curves}")
        first = next(iter(self.verify_curves.values()))
        self.decode_points = _curve(decode_points) if decode_points is not None else first
        # Every step asks for the same few shapes: each is interpolated once.
        self._verify: dict[tuple[int, int], float] = {}
        self._decode: dict[int, float] = {}

    @classmethod
    def linear(cls, token_cost: float) -> StepCost:
        """``(1 + c * T) / (1 + c)``: a fixed cost per step plus ``c`` of it per token."""
        return cls({1: ((1, 1.0), (2, (1 + 2 * token_cost) / (1 + token_cost)))})

    def decode(self, rows: int) -> float:
        """A step of ``rows`` one-token decode rows."""
        cost = self._decode.get(rows)
        if cost is None:
            cost = self._decode[rows] = _interpolate(self.decode_points, rows)
        return cost

    def verify(self, rows: int, drafts: int) -> float:
        """A step of ``rows`` rows verifying ``drafts`` drafts among them."""
        cost = self._verify.get((rows, drafts))
        if cost is None:
            extra = {r: _interpolate(c, r + drafts) - _interpolate(c, r) for r, c in self.verify_curves.items()}
            cost = self._verify[rows, drafts] = self.decode(rows) + _between(extra, rows)
        return cost


def _between(values: dict[int, float], x: int) -> float:
    """``values`` (sorted keys) read at ``x``: linear between neighbouring keys, held past the ends."""
    keys = list(values)
    if x <= keys[0] or len(keys) == 1:
        return values[keys[0]]
    for k0, k1 in pairwise(keys):
        if x <= k1:
            return values[k0] + (values[k1] - values[k0]) * (x - k0) / (k1 - k0)
    return values[keys[-1]]


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
        word_pieces: Collection[int] = frozenset(),
    ) -> None:
        self.max_k = max_k
        self.word_pieces = frozenset(word_pieces)
        self.step_cost = step_cost if step_cost is not None else StepCost(DEFAULT_VERIFY_COSTS, DEFAULT_DECODE_COSTS)
        self.decay = decay
        self.min_gain = DEFAULT_MIN_GAIN if min_gain is None else min_gain
        self._floors: dict[int, float] = {}  # per batch size, see _floor
        # The engine's probe back-off: the longest idle gap a probe has been given since a
        # probe or a verified run was last kept whole (by any request); no probe waits less.
        self.probe_gap = PROBE_FIRST_GAP

    def allocate(
        self,
        states: Sequence[DraftState],
        caps: Sequence[int],
        proposals: Sequence[Sequence[int]] | None = None,
    ) -> list[int]:
        """Drafts for each of a step's decoding requests (``caps[i]``: at most that many for request
        ``i``; ``proposals[i]``: its drafts, when known, so that those inside split words are priced
        at the request's ``piece_rate``)."""
        num = len(states)
        if not num:
            return []
        drafts = proposals if proposals is not None else [()] * num
        firsts = [self._rate(s, d, 0) if c > 0 else 0.0 for s, c, d in zip(states, caps, drafts)]
        if max(firsts, default=0.0) <= self._floor(num):  # the common case of text that does not copy
            return [0] * num
        values = []  # (the chance that a draft and all before it are kept, its request)
        for i, (state, cap, proposal) in enumerate(zip(states, caps, drafts)):
            value = 1.0
            for j in range(min(cap, self.max_k)):
                value *= self._rate(state, proposal, j)
                values.append((value, i))
        values.sort(key=lambda v: -v[0])  # each request's values fall, so the best m are prefixes
        cost = self.step_cost
        best_m, best_rate = 0, num / cost.decode(num) * self.min_gain
        tokens = float(num)
        for m, (value, _) in enumerate(values, 1):
            tokens += value
            rate = tokens / cost.verify(num, m)
            if rate > best_rate:
                best_m, best_rate = m, rate
        out = [0] * num
        for _, i in values[:best_m]:
            out[i] += 1
        return out

    def _rate(self, state: DraftState, proposal: Sequence[int], j: int) -> float:
        """The chance that draft ``j`` is kept given that those before it are."""
        if self._in_split_word(proposal, j):
            return state.piece_rate
        if not (j or state.in_run):
            return state.start_rate
        return state.copy_rate if state.from_prompt else state.next_rate

    def _in_split_word(self, proposal: Sequence[int], j: int) -> bool:
        """Draft ``j`` is a word piece, or the start of a word whose next piece follows it."""
        pieces = self.word_pieces
        if not pieces or j >= len(proposal):
            return False
        return proposal[j] in pieces or (j + 1 < len(proposal) and proposal[j + 1] in pieces)

    def _floor(self, num: int) -> float:
        """A draft value no step of ``num`` rows drafts at: if no request's first draft is worth
        more, no ``m`` drafts pay, since each is worth at most that (values fall along a
        proposal). ``m`` pays when ``(num + m * v) / verify(num, m)`` beats plain decoding,
        i.e. ``v > (best * verify(num, m) - num) / m``; the floor is that bound's least over
        every ``m`` a step could verify. ``verify(num, m)`` is linear in ``m`` between the
        curves' points, where the bound is monotone, so only those points and the ends count."""
        floor = self._floors.get(num)
        if floor is None:
            cost, top = self.step_cost, num * self.max_k
            best = num / cost.decode(num) * self.min_gain
            ends = {1, top} | {t - r for r, curve in cost.verify_curves.items() for t, _ in curve if 1 <= t - r <= top}
            bounds = ((best * cost.verify(num, m) - num) / m for m in ends)
            floor = self._floors[num] = min(bounds) * (1 - 1e-9)  # a float sum may round up
        return floor

    def num_drafts(self, state: DraftState, batch_size: int = 1) -> int:
        """Drafts worth verifying for one request in a step of ``batch_size`` like it."""
        return self.allocate([state] * batch_size, [self.max_k] * batch_size)[0]

    def drafter_drafts(self, state: DraftState, allocated: int) -> int:
        """Drafts a costly drafter proposes for a request the allocation gave
        ``allocated``: that many, or a probe when it is zero and one is due
        (one draft, or ``max_k`` after a probe kept whole; ``state.probing`` says
        it is one, for the scheduler to shadow-score its proposal instead of
        verifying it); one call per sampling step, deterministic."""
        state.probing = False
        if allocated > 0:
            state.probe_wait, state.probe_gap = PROBE_FIRST_GAP, PROBE_FIRST_GAP
            return allocated
        if state.probe_wait > 0 or state.shadow:  # not due, or the last probe is still being scored
            state.probe_wait = max(state.probe_wait - 1, 0)
            state.in_run &= bool(state.shadow)  # an idle step's token is not scored: no run stands after it
            return 0
        state.probing = True
        wait = self.probe_gap = max(state.probe_gap, self.probe_gap)
        state.probe_wait, state.probe_gap = wait, min(2 * wait, PROBE_MAX_GAP)
        # A probe proposes one draft (each further one costs a head step and an LM-head
        # pass), enough to notice agreement; one kept whole earns a full-length probe next.
        full, state.probe_full = state.probe_full, False
        return self.max_k if full else 1

    def observe(self, state: DraftState, num_drafts: int, num_accepted: int) -> None:
        """A verified run: ``num_accepted`` of ``num_drafts`` drafts kept (a drafter's; one kept
        whole, like a probe kept whole, sets the engine's probe back-off back to its start)."""
        for _ in range(num_accepted):
            self._score(state, True)
        if num_accepted < num_drafts:
            self._score(state, False)
        elif num_drafts:
            self.probe_gap = PROBE_FIRST_GAP

    def shadow(self, state: DraftState, proposal: list[int], from_prompt: bool = False) -> None:
        """Score ``proposal`` (verified or not) against the tokens that follow, in place of any
        earlier one (``from_prompt``: it copies the prompt, so its drafts inside a run are priced
        and scored at ``copy_rate``). An empty proposal predicts nothing: the next token leaves
        any run."""
        state.shadow, state.shadow_matched, state.from_prompt = list(proposal), 0, from_prompt
        state.in_run &= bool(proposal)

    def observe_tokens(self, state: DraftState, tokens: list[int]) -> None:
        """Tokens the request just emitted (after its verified drafts, if any): they score the shadow.

        Each token counts at once, not when the run ends: a request that starts
        copying is priced up a token at a time, so it drafts a few steps after
        its first match instead of after a whole proposal's length of one-token
        steps."""
        if not state.shadow:
            return
        for t in tokens:
            j = state.shadow_matched
            matched = t == state.shadow[j]
            self._score(state, matched, piece=self._in_split_word(state.shadow, j))
            state.shadow_matched += matched
            if not matched or state.shadow_matched == len(state.shadow):  # the run is over
                if matched:  # kept whole: a drafter probes again at once, at full length
                    state.probe_wait, state.probe_gap, state.probe_full = 0, PROBE_FIRST_GAP, True
                    self.probe_gap = PROBE_FIRST_GAP  # the head agrees somewhere: every request backs off anew
                state.shadow = []
                return

    def _score(self, state: DraftState, kept: bool, piece: bool = False) -> None:
        """One token against the draft that stood for it, counted where the request stood
        (``piece``: the draft was inside a split word, wherever it stood)."""
        d = self.decay
        if piece:
            state.piece_kept, state.piece_missed = state.piece_kept * d + kept, state.piece_missed * d + (not kept)
        elif state.in_run and state.from_prompt:
            state.copy_kept, state.copy_missed = state.copy_kept * d + kept, state.copy_missed * d + (not kept)
        elif state.in_run:
            state.next_kept, state.next_missed = state.next_kept * d + kept, state.next_missed * d + (not kept)
        else:
            state.start_kept, state.start_missed = state.start_kept * d + kept, state.start_missed * d + (not kept)
        state.in_run = kept
