import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from omnistage.sampling_params import INT32_MAX, MAX_N, SEED_MAX, SEED_MIN, SamplingParams
from omnistage.worker.sampler import SamplingState

NAN, INF = float("nan"), float("inf")
HUGE = 10**20  # past int64: issue 13, defect 1

# field -> values that must be refused (wrong type, out of range, past the engine's dtypes).
BAD = {
    "n": [0, -1, MAX_N + 1, HUGE, 1.5, "2", True, None],
    "temperature": [-0.1, NAN, INF, -INF, 1e39, "1", None],
    "top_p": [0.0, -0.5, 1.5, NAN, INF, None],
    "top_k": [-2, INT32_MAX + 1, HUGE, 2.0, "5", None],
    "min_p": [-0.1, 2.0, NAN, INF],
    "seed": [SEED_MAX + 1, SEED_MIN - 1, HUGE, 1.0, "7"],
    "max_tokens": [0, -1, INT32_MAX + 1, HUGE, 4.0, "4"],
    "min_tokens": [-1, INT32_MAX + 1, HUGE, 1.0, None],
    "logprobs": [-1, INT32_MAX + 1, HUGE, 1.0],
    "prompt_logprobs": [-1, INT32_MAX + 1, 1.0, "2", True],
    "repetition_penalty": [0.0, -1.0, 1e-39, 1e39, NAN, INF, "1.1", None],
    "presence_penalty": [-2.01, 2.01, NAN, INF, -INF, None],
    "frequency_penalty": [-2.01, 2.01, NAN, INF, None],
    "stop": [[""], [1], ["ok", ""], 5],
    "stop_token_ids": [[-1], [INT32_MAX + 1], [HUGE], [1.0], ["3"], 3, "3"],
    "suppress_token_ids": [[-1], [HUGE], [2.5], 1],
    "allowed_token_ids": [[], [-1], [HUGE], [0.5], 2],
    "logit_bias": [{"x": 1}, {-1: 1}, {"-1": 1}, {HUGE: 1}, {1.0: 1}, {True: 1}, {1: NAN}, {1: 101}, {1: "2"}, [1], 5],
    "truncate_prompt_tokens": [0, -2, INT32_MAX + 1, -1.0, 1.5, "4", True],
    "ignore_eos": ["false", 1, None],
    "include_stop_str_in_output": ["yes", 0],
    "skip_special_tokens": ["no", None],
}
# field -> values at the edges of the ranges that must be accepted.
GOOD = {
    "n": [1, MAX_N, np.int64(2), np.int32(1)],
    "temperature": [0.0, 1e-6, 2.0, 1e30],
    "top_p": [1e-9, 1.0],
    "top_k": [-1, 0, 1, INT32_MAX],
    "min_p": [0.0, 1.0],
    "seed": [None, SEED_MIN, 0, SEED_MAX, np.int64(5)],
    "max_tokens": [None, 1, INT32_MAX],
    "min_tokens": [0, 16],
    "logprobs": [None, 0, 20],
    "prompt_logprobs": [None, 0, 5],
    "repetition_penalty": [1e-30, 1.0, 1.05, 1e30],
    "presence_penalty": [-2.0, 0.0, 2.0],
    "frequency_penalty": [-2.0, 2.0],
    "stop": [None, "END", ["a", "b"], ("a",)],
    "stop_token_ids": [None, [], [0, INT32_MAX], (1, 2), np.array([3, 4])],
    "suppress_token_ids": [[], [0, 3]],
    "allowed_token_ids": [None, [0], [1, 2]],
    "logit_bias": [None, {}, {0: -100, INT32_MAX: 100}, {"5": 1.5, " 6": -2}, {np.int64(3): np.float32(0.5)}],
    "truncate_prompt_tokens": [None, -1, 1, INT32_MAX],
}


@pytest.mark.parametrize("field, value", [(f, v) for f, vs in BAD.items() for v in vs])
def test_bad_values_are_refused_naming_the_field_and_range(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} must be .*got"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("field, value", [(f, v) for f, vs in GOOD.items() for v in vs])
def test_values_at_the_edges_are_accepted_and_fit_the_sampler(field, value):
    params = SamplingParams(**{field: value})
    SamplingState(2, 8, [0], torch.device("cpu")).set_row(1, params)


def test_every_field_is_checked():
    """A new field must get its check (and a line in BAD)."""
    assert {f.name for f in dataclasses.fields(SamplingParams)} == set(BAD)


def test_defect_1_values_past_64_bits_never_reach_the_sampler():
    with pytest.raises(ValueError, match=r"SamplingParams\.top_k must be .*2147483647.*got 100000000000000000000"):
        SamplingParams(max_tokens=4, top_k=HUGE, temperature=1.0)
    with pytest.raises(ValueError, match=r"SamplingParams\.min_tokens must be"):
        SamplingParams(max_tokens=None, min_tokens=HUGE)


def test_seed_leaves_room_for_every_completion():
    SamplingParams(n=4, seed=SEED_MAX - 3)
    with pytest.raises(ValueError, match=r"SamplingParams\.seed must be .*seed \+ i"):
        SamplingParams(n=4, seed=SEED_MAX - 2)


def test_replace_and_validate_check_again():
    params = SamplingParams()
    with pytest.raises(ValueError, match="top_k"):
        dataclasses.replace(params, top_k=HUGE)
    params.min_tokens = HUGE  # changed after construction
    with pytest.raises(ValueError, match="min_tokens"):
        params.validate()


def test_min_tokens_above_max_tokens_is_rejected():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=2)


def test_check_vocab():
    SamplingParams(logprobs=8, allowed_token_ids=[7], top_k=100).check_vocab(8)  # top_k past V keeps all
    with pytest.raises(ValueError, match=r"^SamplingParams\.logprobs "):
        SamplingParams(logprobs=9).check_vocab(8)
    with pytest.raises(ValueError, match=r"^SamplingParams\.prompt_logprobs \(9\) exceeds the vocabulary size 8"):
        SamplingParams(prompt_logprobs=9).check_vocab(8)
    with pytest.raises(ValueError, match=r"^SamplingParams\.allowed_token_ids .*\[8\]"):
        SamplingParams(allowed_token_ids=[1, 8]).check_vocab(8)
    with pytest.raises(ValueError, match=r"^SamplingParams\.logit_bias .*vocabulary size 8, got \[8, 9\]"):
        SamplingParams(logit_bias={9: 1.0, 7: 2.0, 8: -1.0}).check_vocab(8)
    # min_tokens keeps EOS (id 2 here) and the stop ids from the first tokens: rules that leave
    # nothing else to sample are refused, naming min_tokens; with ignore_eos, EOS stays allowed.
    no_other = [
        SamplingParams(min_tokens=3, allowed_token_ids=[2]),
        SamplingParams(min_tokens=3, allowed_token_ids=[2, 5], stop_token_ids=[5]),
        SamplingParams(min_tokens=3, suppress_token_ids=[0, 1, 3, 4, 5, 6, 7]),
    ]
    for params in no_other:
        with pytest.raises(ValueError, match=r"^SamplingParams\.min_tokens \(3\) keeps the end-of-sequence"):
            params.check_vocab(8, eos_token_ids=[2])
    SamplingParams(min_tokens=3, allowed_token_ids=[2], ignore_eos=True).check_vocab(8, eos_token_ids=[2])
    SamplingParams(min_tokens=3, allowed_token_ids=[2, 6]).check_vocab(8, eos_token_ids=[2])
    SamplingParams(allowed_token_ids=[2]).check_vocab(8, eos_token_ids=[2])  # no min_tokens: EOS may come first


def test_normalisation():
    params = SamplingParams(stop="END", top_k=-1, temperature=0)
    assert params.stop == ["END"]
    assert params.top_k == 0
    assert params.greedy
    assert SamplingParams(temperature=1e-6).greedy  # below vLLM's epsilon: greedy, never a tiny divisor
    assert not SamplingParams().has_penalties and SamplingParams(presence_penalty=0.1).has_penalties


_numbers = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, -1, INT32_MAX, INT32_MAX + 1, 2**63, 2**64, 0.5, 1e-39, 2.0]),
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(sorted(set(BAD) - {"stop"})), _numbers, max_size=4))
def test_any_numbers_are_refused_or_fit_the_sampler(fields):
    """Whatever numbers come in: a ValueError naming one of the fields, or
    params whose every value the sampler's state holds."""
    for name in ("stop_token_ids", "suppress_token_ids", "allowed_token_ids"):
        if name in fields:
            fields[name] = [fields[name]]
    try:
        params = SamplingParams(**fields)
    except ValueError as e:
        assert any(f"SamplingParams.{name} " in str(e) for name in fields), str(e)
        return
    state = SamplingState(2, 16, [0], torch.device("cpu"))
    try:
        state.set_row(0, params)
    except ValueError as e:  # only the vocabulary-dependent refusal may remain
        assert "allowed_token_ids" in str(e)
        return
    assert math.isfinite(float(state.temperature[0])) and state.top_k[0] >= 0
    if params.seed is not None:
        for i in range(params.n):
            torch.Generator().manual_seed(params.seed + i)
