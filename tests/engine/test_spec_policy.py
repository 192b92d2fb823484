"""The draft policy (``core/spec_policy.py``) and the speculative-decoding metrics.

The policy only decides how many drafts are verified, never what is
emitted: outputs with it equal speculation off. On text the model does not
repeat (a plain random checkpoint) it stops drafting after a few rejected
runs; on text it copies (the bigram "copying" checkpoint inside its cycle)
it keeps drafting at full length. Its shadow scoring brings drafting back
when a request starts copying. Metrics: per request, totals, ``/metrics``.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_spec_ngram import NGRAM, _in_cycle, copying  # noqa: F401  (copying is a fixture)
from utils_engine import PROMPTS, make_engine, run_all

from omnistage.core.config import SchedulerConfig
from omnistage.core.scheduler import Scheduler
from omnistage.core.spec_decode import SpeculativeConfig
from omnistage.core.spec_policy import DraftPolicy, DraftState, StepCost
from omnistage.engine.detokenizer import word_piece_ids
from omnistage.entrypoints.openai.metrics import ServerMetrics, normalize_engine_stats
from omnistage.sampling_params import SamplingParams
from omnistage.testing.tiny_checkpoints import build_tiny_tokenizer


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


# -- the policy alone ---------------------------------------------------------------


def test_policy_shrinks_on_rejections_and_grows_on_acceptance():
    policy = DraftPolicy(max_k=6)  # the default (measured) step cost
    state = DraftState()
    assert policy.num_drafts(state) == 0  # an unseen request (a first draft at 0.25) starts in the shadow
    for _ in range(6):
        policy.observe(state, 6, 6)  # full runs (in the shadow or verified)
    assert policy.num_drafts(state) == 6
    ks = []
    for _ in range(12):
        policy.observe(state, policy.num_drafts(state) or 1, 0)
        ks.append(policy.num_drafts(state))
    assert ks == sorted(ks, reverse=True) and ks[-1] == 0  # shrinks, then stops


def test_policy_prices_drafts_by_the_step_cost_and_the_batch():
    linear = DraftPolicy(max_k=8, step_cost=StepCost.linear(0.05), min_gain=1.05)
    state = DraftState.with_counts(6.0, 4.0)  # a = 0.6
    ks = [linear.num_drafts(state, b) for b in (1, 8, 64)]
    assert ks[0] > ks[1] > ks[2]  # the fixed cost is shared by more decodes: drafts must be better
    free = DraftPolicy(max_k=4, step_cost=StepCost({1: ((1, 1.0), (2, 1.0))}), min_gain=1.0)
    assert free.num_drafts(DraftState.with_counts(0.01, 1.0), 16) == 4
    assert DraftPolicy(max_k=4, step_cost=StepCost.linear(100.0)).num_drafts(DraftState.with_counts(9.0, 1.0)) == 0
    # Requests differ: the better one gets the drafts; caps are respected.
    good, bad = (
        DraftState.with_counts(9.0, 1.0),
        DraftState.with_counts(1.0, 9.0),
    )
    assert (
        linear.allocate([bad, good, good], [8, 8, 2]) == [0, 8, 2]
        or linear.allocate([bad, good, good], [8, 8, 2])[0] < linear.allocate([bad, good, good], [8, 8, 2])[1]
    )
    # The default curve and margin: an unseen request does not pay, a = 0.95 drafts in full.
    assert DraftPolicy(max_k=8).num_drafts(DraftState()) == 0
    assert DraftPolicy(max_k=8).num_drafts(DraftState.with_counts(19.0, 1.0)) == 8
    with pytest.raises(ValueError, match="increasing tokens"):
        StepCost({2: ((2, 1.0), (1, 2.0))})


def _expected_tokens(states: list[DraftState], split: list[int], proposals=None, pieces=frozenset()) -> float:
    """A step's tokens if request ``i`` verifies ``split[i]`` drafts, as the policy values them:
    a draft inside a split word (a piece, or followed by one) at the request's piece rate, a
    run's first at its start rate unless it stands in a run, every other at its next rate (its
    copy rate if the proposal copies the prompt)."""
    tokens = float(len(states))
    for i, (s, k) in enumerate(zip(states, split)):
        d = proposals[i] if proposals is not None else []
        value = 1.0
        for j in range(k):
            if j < len(d) and (d[j] in pieces or (j + 1 < len(d) and d[j + 1] in pieces)):
                value *= s.piece_rate
            else:
                value *= (s.copy_rate if s.from_prompt else s.next_rate) if j or s.in_run else s.start_rate
            tokens += value
    return tokens


def _best_split(policy: DraftPolicy, states: list[DraftState], caps: list[int], proposals=None) -> list[int]:
    """The documented rule, by brute force: every way to split drafts over the requests
    (prefixes of each one's proposal), the one with the most expected tokens per unit
    time, if it beats plain decoding by ``min_gain``; no drafts otherwise."""
    num, cost = len(states), policy.step_cost
    best, best_rate = [0] * num, num / cost.decode(num) * policy.min_gain
    for split in itertools.product(*(range(min(c, policy.max_k) + 1) for c in caps)):
        tokens = _expected_tokens(states, split, proposals, policy.word_pieces)
        rate = tokens / cost.verify(num, sum(split))
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = list(split), rate
    return best


_counts = st.floats(0.0, 20.0).map(lambda x: round(x, 1))
_states = st.builds(DraftState, start_kept=_counts, start_missed=_counts.map(lambda x: x + 0.1),
                    next_kept=_counts, next_missed=_counts.map(lambda x: x + 0.1), in_run=st.booleans(),
                    piece_kept=_counts, piece_missed=_counts.map(lambda x: x + 0.1),
                    copy_kept=_counts, copy_missed=_counts.map(lambda x: x + 0.1), from_prompt=st.booleans())


_STEP_COSTS = [
    None,  # the default (measured) curves
    StepCost.linear(0.05),
    StepCost({1: ((1, 1.0), (2, 1.0))}),  # drafts cost nothing
    StepCost({1: ((1, 1.0), (2, 1.6), (3, 1.7), (5, 1.8)), 2: ((2, 1.2), (4, 2.5), (9, 3.0))}),  # concave, two curves
    StepCost({1: ((1, 1.0), (2, 1.1), (3, 1.2), (5, 3.0))}),  # the first two drafts cheap, the rest dear
]


@given(
    st.lists(st.tuples(_states, st.lists(st.sampled_from([1, 2, 9]), max_size=4)), min_size=1, max_size=3),
    st.sampled_from([1.0, 1.1, 1.3]),
    st.sampled_from(range(len(_STEP_COSTS))),
    st.booleans(),
)
def test_allocation_is_the_best_split_of_drafts(requests, min_gain, cost, known):
    """The policy's greedy pick (values sorted, best prefix) and its early exit for
    requests whose first draft is worth too little agree with trying every split,
    with the proposals known (token 9 a word piece) or only their lengths."""
    policy = DraftPolicy(max_k=4, step_cost=_STEP_COSTS[cost], min_gain=min_gain, word_pieces={9})
    states, caps = [s for s, _ in requests], [len(d) for _, d in requests]
    proposals = [d for _, d in requests] if known else None
    got, want = policy.allocate(states, caps, proposals), _best_split(policy, states, caps, proposals)
    tokens = lambda split: _expected_tokens(states, split, proposals, policy.word_pieces)  # noqa: E731
    rate = lambda split: tokens(split) / policy.step_cost.verify(len(split), sum(split))  # noqa: E731
    assert got == want or rate(got) == pytest.approx(rate(want), rel=1e-9)  # equal, or a tie as good


def test_shadow_scores_a_proposal_against_the_tokens_that_follow():
    policy = DraftPolicy(max_k=4)
    d = policy.decay
    state = DraftState.with_counts(0.0, 1.0)
    policy.shadow(state, [9, 9])
    policy.shadow(state, [5, 6, 7])  # the newest proposal takes the place of the last
    policy.observe_tokens(state, [5])  # the first token outside a run: a start, kept
    assert (state.start_kept, state.start_missed, state.in_run) == (1.0, d, True)
    policy.observe_tokens(state, [6])  # right after a predicted one: counted as a next
    assert state.shadow == [5, 6, 7]
    # Each token counts at once: the estimate rises while the run is still being scored.
    assert (state.next_kept, state.next_missed) == (1.0, d)
    policy.observe_tokens(state, [8])  # mismatch at the third: the run ends, outside a run again
    assert state.shadow == [] and not state.in_run
    assert (state.next_kept, state.next_missed) == (d, d * d + 1.0)
    policy.shadow(state, [1, 2])
    policy.observe_tokens(state, [1, 2, 3])  # all matched (the 3 is past it): no miss counted
    assert state.shadow == [] and state.in_run
    assert (state.start_kept, state.start_missed) == (d + 1.0, d * d)
    policy.shadow(state, [])  # nothing proposed: the next token leaves the run
    assert not state.in_run


def test_drafts_are_priced_by_where_the_request_stands_in_a_run():
    """Text copied with an edit every so often: a run's first draft is a guess, the rest
    are nearly sure. Two rates draft nothing at a run's start and more the longer the
    run goes on; one rate over the same tokens cannot tell the two apart."""
    policy = DraftPolicy(max_k=8)  # the default (measured) step cost
    state = DraftState()
    for _ in range(6):  # a run of 15 kept after its start, then an edit; a fresh lookup that misses
        policy.shadow(state, [1] * 16)
        policy.observe_tokens(state, [1] * 15 + [2])
        policy.shadow(state, [1] * 16)
        policy.observe_tokens(state, [2])
    assert state.start_rate < 0.5 < 0.75 < state.next_rate and not state.in_run
    at_start = policy.num_drafts(state, 8)
    in_run = []
    policy.shadow(state, [1] * 16)
    for _ in range(5):
        policy.observe_tokens(state, [1])
        in_run.append(policy.num_drafts(state, 8))
    assert at_start == 0 < in_run[0] and in_run == sorted(in_run) and in_run[-1] >= 4
    one_rate = DraftState.with_counts(6 * 16.0, 6 * 2.0)  # every token above, kept or missed
    assert policy.num_drafts(one_rate, 8) > 0  # at a start too: about one in two of those drafts is wasted


def test_drafts_copying_the_prompt_are_priced_apart_from_repeats_of_the_reply():
    """A reply that copies a text from its prompt and now and then repeats a phrase of its
    own (the runs open-ended chat has): the copies hold, the repeats break off after a
    token. Priced apart, inside a run at batch 8 a proposal copying the prompt drafts and a
    repeat of the reply does not; each source's tokens count for its own rate."""
    policy = DraftPolicy(max_k=8)  # the default (measured) step cost
    state = DraftState()
    for _ in range(6):
        policy.shadow(state, [1] * 16, from_prompt=True)
        policy.observe_tokens(state, [1] * 15 + [2])  # a long copy, then an edit
        policy.shadow(state, [3, 4, 5, 6])
        policy.observe_tokens(state, [3, 7])  # a repeat of the reply, kept for one token
    assert state.next_rate < 0.1 < 0.75 < state.copy_rate
    state.in_run = True  # inside a run
    policy.shadow(state, [1] * 8, from_prompt=True)
    copies = policy.allocate([state] * 8, [8] * 8, [[1] * 8] * 8)
    policy.shadow(state, [1] * 8)
    assert policy.allocate([state] * 8, [8] * 8, [[1] * 8] * 8) == [0] * 8 != copies
    # A copy's miss inside a run counts against the copies only.
    before = (state.next_kept, state.next_missed, state.copy_missed)
    policy.shadow(state, [1, 1], from_prompt=True)
    policy.observe_tokens(state, [2])
    assert (state.next_kept, state.next_missed) == before[:2] and state.copy_missed > before[2]


def test_drafts_inside_split_words_are_priced_apart():
    """Text copied with typos fixed: the edits fall on misspelt words, which the tokenizer
    splits into pieces (here 9 continues the word 3 starts). Priced apart, the request
    learns that whole words copy and split ones do not: it drafts a clean proposal in
    full and stops before a split word; one record for both drafts a few of either. A
    request whose split words copy too (an e-mail address in JSON) drafts through them."""
    pieces = {9}
    typo_text, json_text = DraftPolicy(max_k=8, word_pieces=pieces), DraftPolicy(max_k=8, word_pieces=pieces)
    typos, copies, one_record = DraftState(), DraftState(), DraftState()
    blind = DraftPolicy(max_k=8)  # the same tokens, no word pieces
    for _ in range(6):  # six words copied, then a misspelt one that the model rewrites
        for policy, state in ((typo_text, typos), (blind, one_record)):
            policy.shadow(state, [1, 2, 1, 2, 1, 2, 3, 9])
            policy.observe_tokens(state, [1, 2, 1, 2, 1, 2, 4])
        json_text.shadow(copies, [1, 2, 1, 2, 1, 2, 3, 9])
        json_text.observe_tokens(copies, [1, 2, 1, 2, 1, 2, 3, 9])
    assert typos.piece_rate < 0.3 < 0.9 < typos.next_rate
    for state in (typos, one_record, copies):
        state.in_run = True  # in the middle of a copied sentence
    clean, split = [1, 2, 1, 2, 1, 2, 1, 2], [1, 2, 3, 9, 1, 2, 1, 2]
    assert typo_text.allocate([typos] * 8, [8] * 8, [clean] * 8) == [8] * 8
    assert typo_text.allocate([typos] * 8, [8] * 8, [split] * 8) == [2] * 8  # up to the split word
    # One record spreads the misses over every draft: a clean proposal gets a few.
    assert max(blind.allocate([one_record] * 8, [8] * 8)) < 4
    assert json_text.allocate([copies] * 8, [8] * 8, [split] * 8) == [8] * 8


def test_word_pieces_come_from_the_tokenizer():
    """The byte-level BPE of the tiny checkpoints: a rare word splits into a word-start token
    and pieces; pieces are exactly the tokens with no word-start marker that begin with a
    letter or digit (never a special token). A vocabulary without markers has none."""
    tokenizer = build_tiny_tokenizer()
    pieces = word_piece_ids(tokenizer)
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    markers = ("\u0120", "\u010a", "\u0109")  # byte-level BPE's space, newline and tab
    assert pieces == {i for i, t in enumerate(tokens) if t[0].isalnum() and not t.startswith(markers)}
    assert not pieces & set(tokenizer.all_special_ids)
    ids = tokenizer.encode(" qzxvjk")
    assert len(ids) > 1 and ids[0] not in pieces and all(i in pieces for i in ids[1:])

    class Unmarked:  # e.g. a character-level vocabulary
        all_special_ids = [0]

        def __len__(self):
            return 4

        def convert_ids_to_tokens(self, ids):
            return ["<s>", "a", "b", "c"]

    assert word_piece_ids(Unmarked()) == frozenset()


# -- the policy in the engine -------------------------------------------------------


def test_random_text_stops_drafting_with_identical_outputs(copying):  # noqa: F811 (the imported fixture)
    loaded, _ = copying("qwen2", 1.0)  # plain random weights: drafts are almost always rejected
    prompts = PROMPTS[:3]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    off = _ids(run_all(make_engine(loaded), prompts, params))
    always = make_engine(loaded, speculative_config=NGRAM)
    always.scheduler.draft_policy = DraftPolicy(
        NGRAM["num_speculative_tokens"],
        step_cost=StepCost({1: ((1, 1.0), (2, 1.0))}),
        min_gain=0.0,
    )
    adaptive = make_engine(loaded, speculative_config=NGRAM)
    assert _ids(run_all(always, prompts, params)) == off
    outs = run_all(adaptive, prompts, params)
    assert _ids(outs) == off
    a, b = always.get_stats(), adaptive.get_stats()
    assert a.num_accepted_tokens <= a.num_draft_tokens // 4  # the workload: low acceptance
    assert b.num_draft_tokens * 3 < a.num_draft_tokens  # far fewer drafts verified
    assert b.num_drafts < 0.5 * sum(len(t) for t in off)  # most steps decode one token
    # Each request stopped: its late steps draft nothing (shadow only).
    for o in outs:
        assert o.metrics.num_drafts < 20


def test_copying_text_keeps_full_drafts(copying):  # noqa: F811 (the imported fixture)
    loaded, _ = copying("llama", 0.0)  # bigram model inside its cycle: drafts are accepted
    prompt = _in_cycle(loaded)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    off_engine = make_engine(loaded)
    off = _ids(run_all(off_engine, [prompt], params))
    on = make_engine(loaded, speculative_config=NGRAM)
    on.add_request("copy", prompt, params)
    (req,) = on.scheduler.requests.values()
    runs, out = [], None
    while on.has_unfinished_requests():
        before = req.num_draft_tokens
        for o in on.step():
            out = o if o.finished else out
        if req.num_draft_tokens > before:
            runs.append(req.num_draft_tokens - before)
    assert _ids([out]) == off
    m, k = out.metrics, NGRAM["num_speculative_tokens"]
    assert m.draft_acceptance_rate > 0.9
    # The shadow's record grows from the prior (not worth drafting), then
    # full-length runs until max_tokens caps the last ones.
    full = runs.index(k)
    assert full <= 8
    assert runs[full : full + 6] == [k] * 6
    assert on.get_stats().num_steps * 2 < off_engine.get_stats().num_steps


def test_shadow_brings_drafting_back(copying):  # noqa: F811 (the imported fixture)
    """A request that stopped drafting on random text drafts again once its text copies."""
    loaded, _ = copying("llama", 0.0)
    cycle = _in_cycle(loaded)["prompt_token_ids"]
    engine = make_engine(loaded, speculative_config=NGRAM)
    (out,) = run_all(
        engine,
        [{"prompt_token_ids": cycle}],
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    )
    assert out.metrics.num_drafts > 0
    # The same request pre-trained to "no drafting" by many rejections: the shadow turns it back on.
    policy = engine.scheduler.draft_policy
    state = DraftState()
    for _ in range(20):
        policy.observe(state, 4, 0)
    assert policy.num_drafts(state, 1) == 0
    engine.add_request(
        "r",
        {"prompt_token_ids": cycle},
        SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True),
    )
    (req,) = engine.scheduler.requests.values()
    req.draft_state = state
    drafted = []
    while engine.has_unfinished_requests():
        engine.step()
        drafted.append(req.num_drafts)
    assert drafted[0] == 0 and drafted[-1] > 0  # off at first, back on from the shadow's evidence


def test_prompt_lookup_prices_the_tokenizers_word_pieces(copying):  # noqa: F811 (the imported fixture)
    """The engine fills the word pieces from the model's tokenizer for prompt lookup; a
    drafter's proposals come after the allocation, so its policy prices none."""
    loaded, _ = copying("qwen2", 0.0)
    engine = make_engine(loaded, speculative_config=NGRAM)
    pieces = engine.scheduler.draft_policy.word_pieces
    assert pieces and pieces == word_piece_ids(loaded.tokenizer)
    eagle = SpeculativeConfig.from_dict({"method": "eagle", "model": "head", "num_speculative_tokens": 2})
    scheduler = Scheduler(SchedulerConfig(speculative_config=eagle.for_model((), pieces)))
    assert scheduler.draft_policy.word_pieces == frozenset()


# -- metrics ------------------------------------------------------------------------


def test_metrics_per_request_totals_and_prometheus(copying):  # noqa: F811 (the imported fixture)
    loaded, _ = copying("qwen2", 0.0)
    prompt = _in_cycle(loaded)
    engine = make_engine(loaded, speculative_config=NGRAM)
    outs = run_all(
        engine,
        [prompt, prompt],
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
    )
    stats = engine.get_stats()
    per_req = [o.metrics for o in outs]
    assert stats.num_drafts == sum(m.num_drafts for m in per_req) > 0
    assert stats.num_draft_tokens == sum(m.num_draft_tokens for m in per_req)
    assert stats.num_accepted_tokens == sum(m.num_accepted_tokens for m in per_req) > 0
    # Per position: non-increasing (a draft is kept only after its predecessors), summing to the total.
    pos = stats.num_accepted_tokens_per_pos
    assert len(pos) == NGRAM["num_speculative_tokens"] and sum(pos) == stats.num_accepted_tokens
    assert list(pos) == sorted(pos, reverse=True) and pos[0] <= stats.num_drafts
    for m in per_req:
        assert m.mean_acceptance_length == 1 + m.num_accepted_tokens / m.num_drafts
    assert stats.mean_acceptance_length == 1 + stats.num_accepted_tokens / stats.num_drafts
    text = ServerMetrics().render(normalize_engine_stats(stats))
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    assert samples["omnistage:spec_decode_num_drafts_total"] == stats.num_drafts
    assert samples["omnistage:spec_decode_num_draft_tokens_total"] == stats.num_draft_tokens
    assert samples["omnistage:spec_decode_num_accepted_tokens_total"] == stats.num_accepted_tokens
    for i, v in enumerate(pos):
        assert samples[f'omnistage:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}'] == v
    # Speculation off: zero counters, no positions.
    off = ServerMetrics().render(normalize_engine_stats(make_engine(loaded).get_stats()))
    assert "omnistage:spec_decode_num_drafts_total 0" in off and 'position="0"' not in off
    assert per_req[0].draft_acceptance_rate is not None
    assert make_engine(loaded).get_stats().mean_acceptance_length is None
