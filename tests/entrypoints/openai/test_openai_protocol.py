"""Request models: strict parsing, errors that name the field."""

from __future__ import annotations

import pytest

from omnistage.entrypoints.openai.errors import APIError
from omnistage.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ImagePart,
    TextPart,
    parse_content_part,
    parse_request,
)
from omnistage.entrypoints.openai.serving_common import _PARAM_FIELDS, build_sampling_params

MSG = [{"role": "user", "content": "hi"}]


def _err(model, body) -> APIError:
    with pytest.raises(APIError) as info:
        parse_request(model, body)
    assert info.value.status_code == 400
    return info.value


def test_valid_chat_request_defaults() -> None:
    req = parse_request(ChatCompletionRequest, {"model": "m", "messages": MSG, "stop": "x", "n": 2})
    assert req.n == 2 and req.stop == "x" and req.stream is False and req.max_tokens is None


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"messages": MSG, "temperature": 3}, "temperature", "less than or equal to 2"),
        ({"messages": MSG, "top_p": 0}, "top_p", "greater than 0"),
        ({"messages": MSG, "n": 0}, "n", "greater than or equal to 1"),
        ({"messages": MSG, "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ({"messages": MSG, "top_logprobs": 21}, "top_logprobs", "20"),
        ({"messages": MSG, "stop": 5}, "stop", "valid"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "'system'"),
        ({"messages": []}, "messages", "at least 1"),
        ({"messages": MSG, "temprature": 0.5}, "temprature", "Unrecognized request argument"),
        ({}, "messages", "Missing required parameter"),
        ({"messages": MSG, "modalities": ["smell"]}, "modalities[0]", "'text'"),
    ],
)
def test_chat_errors_name_the_field(body, param, words) -> None:
    err = _err(ChatCompletionRequest, body)
    assert err.param == param, err.message
    assert words in err.message


def test_body_must_be_object() -> None:
    assert "JSON object" in _err(ChatCompletionRequest, [1, 2]).message


@pytest.mark.parametrize(
    "prompt", ["hello", ["a", "b"], [1, 2, 3], [[1, 2], [3]]]
)
def test_completion_prompt_shapes(prompt) -> None:
    assert parse_request(CompletionRequest, {"prompt": prompt}).prompt == prompt


def test_completion_prompt_required_and_typed() -> None:
    assert _err(CompletionRequest, {}).param == "prompt"
    assert _err(CompletionRequest, {"prompt": {"a": 1}}).param == "prompt"


def test_content_parts() -> None:
    assert isinstance(parse_content_part({"type": "text", "text": "x"}, "p"), TextPart)
    part = parse_content_part({"type": "image_url", "image_url": {"url": "data:,"}}, "p")
    assert isinstance(part, ImagePart)
    with pytest.raises(APIError) as info:
        parse_content_part({"type": "video"}, "messages[0].content[2]")
    assert info.value.param == "messages[0].content[2].type" and "'video'" in info.value.message
    with pytest.raises(APIError) as info:
        parse_content_part({"type": "image_url", "image_url": {}}, "messages[0].content[1]")
    assert info.value.param == "messages[0].content[1].image_url.url"
    with pytest.raises(APIError) as info:
        parse_content_part({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "ogg"}}, "m")
    assert info.value.param == "m.input_audio.format"


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("top_k", 10**20, "less than or equal to 2147483647"),  # took the engine down (OverflowError in the sampler)
        ("min_tokens", 10**20, "less than or equal to 2147483647"),
        ("max_tokens", 2**63, "less than or equal to 9223372036854775807"),
        ("n", 10**20, "less than or equal to 128"),
        ("repetition_penalty", 0.0, "greater than or equal to 0.01"),
        ("logit_bias", {"7": 500.0}, "less than or equal to 100"),
        ("stop_token_ids", [3, 2**40], "less than or equal to"),
        ("max_tokens", "8", "valid integer"),
        ("max_tokens", True, "valid integer"),
        ("max_tokens", 8.0, "valid integer"),
        ("temperature", float("inf"), "finite number"),
        ("temperature", False, "valid number"),
        ("stream", "false", "valid boolean"),
    ],
)
def test_numbers_are_bounded_strict_and_finite(field, value, words) -> None:
    err = _err(ChatCompletionRequest, {"messages": MSG, field: value})
    assert err.param.split(".")[0].split("[")[0] == field, err.message
    assert words in err.message


def _chat(**kw: object) -> ChatCompletionRequest:
    return parse_request(ChatCompletionRequest, {"messages": MSG, **kw})


def test_tiny_temperatures_are_greedy() -> None:
    assert build_sampling_params(_chat(temperature=1e-30), 4, None).temperature == 0.0
    assert build_sampling_params(_chat(temperature=0.5), 4, None).temperature == 0.5


def test_penalties_reach_sampling_params() -> None:
    req = _chat(presence_penalty=1.5, frequency_penalty=-0.5, repetition_penalty=1.3)
    params = build_sampling_params(req, 4, None)  # accepted whether or not the sampler applies them yet
    names = {"presence_penalty", "frequency_penalty", "repetition_penalty"}
    if not names <= _PARAM_FIELDS:
        pytest.skip("SamplingParams has no penalty fields yet (they come with the sampler's change)")
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (1.5, -0.5, 1.3)


def test_logit_bias_reaches_sampling_params_with_integer_ids() -> None:
    assert build_sampling_params(_chat(logit_bias={"7": 2.5, "11": -100}), 4, None).logit_bias == {7: 2.5, 11: -100}
    assert build_sampling_params(_chat(logit_bias={}), 4, None).logit_bias is None
