"""The step costs a speculating engine measures when it starts (``worker/step_costs.py``)
and the draft policy's use of them (``core/spec_policy.py``).

The measurement must see what a step really costs (a forward slowed by a known
amount per token shows up in the curves), must leave nothing behind that a
request could read (outputs equal speculation off; no dense view keeps its
buffers), and the policy must price a draft by the rows it joins.
"""

from __future__ import annotations

import time

import pytest
from test_spec_ngram import NGRAM
from utils_engine import PROMPTS, make_engine, run_all

from omnistage.attention.kv_cache import dense_view
from omnistage.core.spec_policy import DEFAULT_DECODE_COSTS, DEFAULT_VERIFY_COSTS, DraftPolicy, DraftState, StepCost
from omnistage.sampling_params import SamplingParams
from omnistage.worker.step_costs import _undo_load_spikes

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
    curves, decode = cost.verify_curves, dict(cost.decode_points)
    # NGRAM drafts up to 4: verify shapes of 1 row x 2, 3, 4 tokens and 8 rows x 2, 3, 5 tokens,
    # each row count's curve starting at its plain decode step.
    assert {rows: [t for t, _ in c] for rows, c in curves.items()} == {1: [1, 2, 3, 4], 8: [8, 16, 24, 40]}
    assert sorted(decode) == [1, 2, 3, 8] and dict(curves[8])[8] == decode[8]
    for points in (*map(dict, curves.values()), decode):
        for tokens, relative in points.items():
            # Load only adds time, to the 1-token step as much as to the others: a wide band.
            assert 0.6 * tokens <= relative <= 1.25 * tokens, (tokens, relative, points)


def test_a_load_spike_never_makes_a_larger_step_look_cheaper():
    measured = {(1, 1): 1.0, (2, 1): 1.3, (3, 1): 1.6, (8, 1): 6.0, (1, 2): 1.2, (1, 9): 3.4, (8, 2): 4.5, (8, 5): 9.0}
    fixed = _undo_load_spikes(measured)
    # The 8-row decode step was hit by load in every round: it costs no more than 8 rows x 2 tokens.
    assert fixed == {**measured, (8, 1): 4.5}
    assert _undo_load_spikes(fixed) == fixed  # consistent timings are kept as they are
    spiked_unit = _undo_load_spikes({**measured, (1, 1): 1.5})
    assert spiked_unit[1, 1] == 1.2  # the unit itself, where a 2-token step of one row measured faster


def test_a_measured_engine_serves_what_speculation_off_serves(tiny_loaded, measuring):
    loaded = tiny_loaded("qwen2")
    engine = make_engine(loaded, speculative_config=NGRAM)
    cost = engine.scheduler.draft_policy.step_cost
    assert cost.verify_curves != DEFAULT_VERIFY_COSTS and cost.decode_points != DEFAULT_DECODE_COSTS
    assert all(dense_view(c).keys is None for c in engine.runner.kv_caches)  # released
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    on = run_all(engine, PROMPTS, params)
    off = run_all(make_engine(loaded), PROMPTS, params)
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    assert engine.held().is_empty


def test_the_switch_keeps_the_built_in_curve(tiny_loaded, monkeypatch):
    monkeypatch.setenv("OMNISTAGE_MEASURE_STEP_COST", "0")
    cost = make_engine(tiny_loaded("llama"), speculative_config=NGRAM).scheduler.draft_policy.step_cost
    assert cost.verify_curves == DEFAULT_VERIFY_COSTS and cost.decode_points == DEFAULT_DECODE_COSTS


def test_a_draft_is_priced_by_the_rows_it_joins():
    # A draft costs a whole decode step at 1 row and an eighth of one at 8 rows.
    cost = StepCost({1: ((1, 1.0), (2, 2.0)), 8: ((8, 4.0), (16, 5.0))}, ((1, 1.0), (8, 4.0)))
    assert cost.verify(1, 1) == 2.0 and cost.verify(1, 3) == 4.0  # extended past the last point
    assert cost.verify(8, 8) == 5.0 and cost.verify(8, 1) == 4.125 and cost.verify(16, 8) == cost.decode(16) + 1.0
    assert cost.verify(8, 0) == cost.decode(8)
    # Between the measured row counts the drafts' extra time is interpolated: 4 rows, 2 drafts.
    assert cost.verify(4, 2) == pytest.approx(cost.decode(4) + 2.0 + (0.25 - 2.0) * 3 / 7)
    policy = DraftPolicy(max_k=1, step_cost=cost, min_gain=1.0)
    state = DraftState.with_counts(6.0, 4.0)  # a = 0.6
    assert policy.num_drafts(state, batch_size=1) == 0  # 1.6 tokens in 2 steps
    assert policy.num_drafts(state, batch_size=8) == 1  # 8 * 1.6 tokens in 5 / 4 steps
    # A step's token count alone would read a draft joining 8 rows off the one-row curve
    # at 9 tokens (here cheaper than the 8-row decode step): drafts that are never kept
    # would look free. Priced by the rows they join, they never pay.
    one_row_9 = StepCost({1: ((1, 1.0), (9, 3.0)), 8: ((8, 4.0), (16, 5.0))}, ((1, 1.0), (8, 4.0)))
    never_kept = DraftState.with_counts(0.0, 5.0)
    assert DraftPolicy(max_k=4, step_cost=one_row_9, min_gain=1.0).allocate([never_kept] * 8, [4] * 8) == [0] * 8
    with pytest.raises(ValueError, match="increasing tokens"):
        StepCost({1: ((1, 1.0), (2, 1.0))}, ((2, 1.0), (1, 1.0)))
    with pytest.raises(ValueError, match="start at R tokens"):
        StepCost({8: ((1, 1.0), (16, 2.0))})
