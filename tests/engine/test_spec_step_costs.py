"""The step costs a speculating engine measures when it starts (``worker/step_costs.py``)
and the draft policy's use of them (``core/spec_policy.py``).

The measurement must see what a step really costs (a forward slowed by a known
amount per token shows up in the curves), must leave nothing behind that a
request could read (outputs equal speculation off; no dense view keeps its
buffers), and the policy must price a plain decode step on its own curve.
"""

from __future__ import annotations

import time

import pytest
from test_spec_ngram import NGRAM
from utils_engine import PROMPTS, make_engine, run_all

from omnistage.attention.kv_cache import dense_view
from omnistage.core.spec_policy import DEFAULT_STEP_COST_POINTS, DraftPolicy, DraftState, StepCost
from omnistage.sampling_params import SamplingParams

SECONDS_PER_TOKEN = 0.003


@pytest.fixture
def measuring(monkeypatch):
    monkeypatch.setenv("OMNISTAGE_MEASURE_STEP_COST", "1")  # tests/conftest.py turns it off


def test_measured_curves_follow_the_forward_cost(tiny_loaded, measuring, monkeypatch):
    loaded = tiny_loaded("llama")
    forward = loaded.model.forward

    def slowed(input_ids, *args, **kwargs):  # the tiny model's own time is well under a token's delay
        time.sleep(SECONDS_PER_TOKEN * input_ids.shape[0])
        return forward(input_ids, *args, **kwargs)

    monkeypatch.setattr(loaded.model, "forward", slowed)
    cost = make_engine(loaded, speculative_config=NGRAM).scheduler.draft_policy.step_cost
    verify, decode = dict(cost.points), dict(cost.decode_points)
    # NGRAM drafts up to 4: verify shapes of 1 row x 2, 3, 4 tokens and 8 rows x 2, 3, 5 tokens.
    assert sorted(verify) == [1, 2, 3, 4, 16, 24, 40] and sorted(decode) == [1, 2, 3, 8]
    for points in (verify, decode):
        for tokens, relative in points.items():
            # Load only adds time, to the 1-token step as much as to the others: a wide band.
            assert 0.6 * tokens <= relative <= 1.25 * tokens, (tokens, relative, points)


def test_a_measured_engine_serves_what_speculation_off_serves(tiny_loaded, measuring):
    loaded = tiny_loaded("qwen2")
    engine = make_engine(loaded, speculative_config=NGRAM)
    cost = engine.scheduler.draft_policy.step_cost
    assert cost.points != DEFAULT_STEP_COST_POINTS and cost.decode_points is not cost.points
    assert all(dense_view(c).keys is None for c in engine.runner.kv_caches)  # released
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    on = run_all(engine, PROMPTS, params)
    off = run_all(make_engine(loaded), PROMPTS, params)
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    assert engine.held().is_empty


def test_the_switch_keeps_the_built_in_curve(tiny_loaded, monkeypatch):
    monkeypatch.setenv("OMNISTAGE_MEASURE_STEP_COST", "0")
    cost = make_engine(tiny_loaded("llama"), speculative_config=NGRAM).scheduler.draft_policy.step_cost
    assert cost.points == DEFAULT_STEP_COST_POINTS and cost.decode_points is cost.points


def test_the_policy_prices_plain_decoding_on_the_decode_curve():
    free_verify = ((1, 1.0), (2, 1.0))
    state = DraftState(accepted=9.0, rejected=1.0)  # a = 0.9
    shared = DraftPolicy(max_k=1, step_cost=StepCost(free_verify), min_gain=1.0)
    assert shared.num_drafts(state, batch_size=2) == 1  # a free draft always pays
    # Two decode rows cost half a verify step of the same width: 2 / 0.5 beats (2 + 2 * 0.9) / 1.
    cheap_decode = DraftPolicy(max_k=1, step_cost=StepCost(free_verify, ((1, 1.0), (2, 0.5))), min_gain=1.0)
    assert cheap_decode.num_drafts(state, batch_size=2) == 0
    with pytest.raises(ValueError, match="increasing tokens"):
        StepCost(free_verify, ((2, 1.0), (1, 1.0)))
