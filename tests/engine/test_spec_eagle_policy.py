"""The draft policy with an EAGLE head: the head is asked for the policy's allocation,
fed each verified run, and a request that stopped drafting is probed with back-off.

Outputs always equal speculation off. A random head (it agrees with the target
almost never) is probed rarely, a draft at a time, in the shadow (never
verified), and once it has failed a request's whole back-off, the next
requests are probed at the longest gap; the accepting head
(``mimic_target_layer=True`` on a bigram target) keeps full runs.
"""

from __future__ import annotations

import pytest
from test_spec_eagle import _eagle, _tokens, targets  # noqa: F401  (targets is a fixture)
from utils_engine import PROMPTS, make_engine, run_all

from omnistage.core.spec_policy import PROBE_FIRST_GAP, PROBE_MAX_GAP, DraftPolicy, DraftState
from omnistage.sampling_params import SamplingParams

K = 3
LONG = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


def test_probes_back_off_exponentially_and_reset_when_drafting_pays():
    policy, state = DraftPolicy(max_k=K), DraftState()
    asks = []
    for _ in range(4 + 7 * PROBE_FIRST_GAP):  # through the fourth probe
        asks.append(policy.drafter_drafts(state, 0))
        if asks[-1]:
            policy.observe(state, asks[-1], 0)
    probes = [i for i, k in enumerate(asks) if k]
    assert probes == [0, 1 + PROBE_FIRST_GAP, 2 + 3 * PROBE_FIRST_GAP, 3 + 7 * PROBE_FIRST_GAP]
    assert [asks[i] for i in probes] == [1, 1, 1, 1]  # one draft each: none was kept whole
    for _ in range(200):
        policy.drafter_drafts(state, 0)
    assert state.probe_gap == PROBE_MAX_GAP
    assert policy.drafter_drafts(state, 2) == 2  # the allocation drafts again: back-off resets
    assert state.probe_gap == PROBE_FIRST_GAP
    assert [policy.drafter_drafts(state, 0) for _ in range(PROBE_FIRST_GAP + 1)][-1] == 1


def test_the_back_off_carries_over_to_new_requests_until_a_probe_is_kept_whole():
    policy = DraftPolicy(max_k=K)

    def probe_steps(state, steps, keep=()):
        """The steps (of ``steps``) ``state`` is probed at; a probe at a step in ``keep`` is kept whole."""
        at = []
        for i in range(steps):
            if policy.drafter_drafts(state, 0):
                at.append(i)
                policy.shadow(state, [7])
                policy.observe_tokens(state, [7 if i in keep else 8])
        return at

    gaps = [PROBE_FIRST_GAP * 2**j for j in range(4)]
    assert gaps[-1] == PROBE_MAX_GAP
    first = probe_steps(DraftState(), 200)  # a head that never agrees: through its whole back-off
    assert [b - a - 1 for a, b in zip(first, first[1:])][:4] == gaps
    # The next request is probed at once, then at the longest gap, not from the first one.
    assert probe_steps(DraftState(), 2 * PROBE_MAX_GAP + 3) == [0, PROBE_MAX_GAP + 1, 2 * PROBE_MAX_GAP + 2]
    # A probe kept whole (by any request) resets the engine's back-off: the next request walks it anew.
    assert probe_steps(DraftState(), 2, keep={0}) == [0, 1]  # kept whole: a full probe follows at once
    assert probe_steps(DraftState(), 1 + PROBE_FIRST_GAP + 1) == [0, PROBE_FIRST_GAP + 1]
    # So does a verified run kept whole (a request the allocation drafts for).
    probe_steps(DraftState(), 200)
    assert policy.probe_gap == PROBE_MAX_GAP
    policy.observe(DraftState(), K, K - 1)  # cut short: no change
    assert policy.probe_gap == PROBE_MAX_GAP
    policy.observe(DraftState(), K, K)
    assert probe_steps(DraftState(), 1 + PROBE_FIRST_GAP + 1) == [0, PROBE_FIRST_GAP + 1]


def test_a_probe_kept_whole_is_followed_at_once_by_a_full_one():
    policy, state = DraftPolicy(max_k=K), DraftState()
    assert policy.drafter_drafts(state, 0) == 1 and state.probing
    policy.shadow(state, [6])
    policy.observe_tokens(state, [6])  # kept whole
    assert policy.drafter_drafts(state, 0) == K and state.probing  # no idle gap, full length
    policy.shadow(state, [7, 8, 9])
    for t in (7, 8):
        policy.observe_tokens(state, [t])
        assert policy.drafter_drafts(state, 0) == 0  # still being scored
    policy.observe_tokens(state, [9])  # kept whole again
    assert policy.drafter_drafts(state, 0) == K and state.probing
    policy.shadow(state, [1, 2, 3])
    policy.observe_tokens(state, [1, 5])  # cut short: back to one-draft probes after a gap
    asks = [policy.drafter_drafts(state, 0) for _ in range(PROBE_FIRST_GAP + 1)]
    assert asks == [0] * PROBE_FIRST_GAP + [1]


def test_random_head_is_probed_in_the_shadow_with_identical_outputs(targets, monkeypatch):  # noqa: F811
    loaded, head, _ = targets("llama", "random")
    off = _tokens(run_all(make_engine(loaded), PROMPTS, LONG))
    probes = []
    shadow = DraftPolicy.shadow
    monkeypatch.setattr(DraftPolicy, "shadow", lambda self, state, p: probes.append(len(p)) or shadow(self, state, p))
    on = make_engine(loaded, speculative_config=_eagle(head, K))
    outs = run_all(on, PROMPTS, LONG)
    assert _tokens(outs) == off
    # Per request: one draft at once, then after 8, 16 and 32 idle steps (the next is due past
    # 64 tokens), each scored against the emitted tokens and none verified: a probe costs no
    # verify step.
    assert probes == [1] * 4 * len(PROMPTS)
    for o in outs:
        assert o.metrics.num_drafts == 0 and o.metrics.num_draft_tokens == 0
    # The next requests start where the back-off got to: probed at once, then after 64 idle
    # steps, past their 64 tokens.
    probes.clear()
    assert _tokens(run_all(on, PROMPTS, LONG)) == off
    assert probes == [1] * len(PROMPTS)


def test_accepting_head_keeps_full_drafts(targets):  # noqa: F811 (the imported fixture)
    loaded, head, _ = targets("llama", "accepting")
    off_engine = make_engine(loaded)
    off = _tokens(run_all(off_engine, PROMPTS, LONG))
    on = make_engine(loaded, speculative_config=_eagle(head, K))
    outs = run_all(on, PROMPTS, LONG)
    assert _tokens(outs) == off
    for o in outs:
        m = o.metrics
        assert m.draft_acceptance_rate > 0.9
        # Full runs (but the first while its record grows, and the last one max_tokens cuts):
        # about K drafts per K + 1 tokens.
        assert m.num_draft_tokens >= 0.9 * K * m.num_drafts
        assert m.num_draft_tokens >= 0.8 * K / (K + 1) * len(o.outputs[0].token_ids)
    assert on.get_stats().num_steps * 2 < off_engine.get_stats().num_steps


@pytest.mark.parametrize("kind", ["random", "accepting"])
def test_policy_decisions_are_deterministic(kind, targets):  # noqa: F811 (the imported fixture)
    loaded, head, _ = targets("qwen2", kind)
    stats = []
    for _ in range(2):
        engine = make_engine(loaded, speculative_config=_eagle(head, K))
        outs = run_all(engine, PROMPTS, LONG)
        stats.append(([o.metrics.num_draft_tokens for o in outs], engine.get_stats().num_steps))
    assert stats[0] == stats[1]
