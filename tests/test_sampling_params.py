import pytest

from omnistage.sampling_params import SamplingParams


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"min_p": 2.0}, "min_p"),
    ],
)
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} must be .*got"):
        SamplingParams(**kwargs)


def test_min_tokens_above_max_tokens_is_rejected():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=2)


def test_normalisation():
    params = SamplingParams(stop="END", top_k=-1, temperature=0)
    assert params.stop == ["END"]
    assert params.top_k == 0
    assert params.greedy
