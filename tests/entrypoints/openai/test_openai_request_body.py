"""Request bodies to JSON: depth found without recursion, oversized integers and
lone surrogates reported with the path of their field."""

from __future__ import annotations

import json
import random
import time

import pytest

from omnistage.entrypoints.openai.errors import APIError
from omnistage.entrypoints.openai.request_body import MAX_JSON_DEPTH, decode_json_body, json_depth


def _reference_depth(value: object) -> int:
    if isinstance(value, dict):
        return 1 + max((_reference_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_reference_depth(v) for v in value), default=0)
    return 0


def _random_json(rng: random.Random, depth: int) -> object:
    kind = rng.random()
    if depth == 0 or kind < 0.3:
        return rng.choice([0, -1.5, True, None, "", "a]b", 'q"[{', "\\", "x\\\"]"])
    if kind < 0.65:
        return [_random_json(rng, depth - 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(["a", "[", "}{", '"']) + str(i): _random_json(rng, depth - 1) for i in range(rng.randint(0, 3))}


def test_depth_matches_the_parsed_document() -> None:
    rng = random.Random(0)
    for _ in range(300):
        doc = _random_json(rng, rng.randint(0, 12))
        text = json.dumps(doc, ensure_ascii=rng.random() < 0.5)
        assert json_depth(text) == _reference_depth(doc), text


def _error(raw: bytes) -> APIError:
    with pytest.raises(APIError) as info:
        decode_json_body(raw)
    assert info.value.status_code == 400
    return info.value


def test_depth_limit_is_checked_before_parsing() -> None:
    ok = json.dumps({"k": json.loads("[" * (MAX_JSON_DEPTH - 1) + "]" * (MAX_JSON_DEPTH - 1))}).encode()
    assert _reference_depth(decode_json_body(ok)) == MAX_JSON_DEPTH
    err = _error(b"[" * 100_000 + b"]" * 100_000)
    assert err.code == "json_too_deep" and "100000 levels deep" in err.message and str(MAX_JSON_DEPTH) in err.message
    start = time.monotonic()
    _error(b"[" * 8_000_000)  # a body at the server's default size limit is scanned in well under a second
    assert time.monotonic() - start < 2.0


def test_oversized_integer_names_its_field() -> None:
    err = _error(b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": ' + b"9" * 4301 + b"}")
    assert err.param == "max_tokens" and "4301 digits" in err.message
    err = _error(b'{"prompt": [1, 2, -' + b"1" * 5000 + b"]}")
    assert err.param == "prompt[2]" and "5000 digits" in err.message
    err = _error(b"9" * 5000)
    assert err.param is None and "5000 digits" in err.message


def test_lone_surrogates_name_their_field() -> None:
    err = _error(json.dumps({"prompt": ["ok", "ab\udc00"]}).encode())
    assert err.param == "prompt[1]" and err.code == "invalid_unicode" and "U+DC00 at character 2" in err.message
    err = _error(json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}).encode())
    assert err.param == "messages[0].content[0].text"
    assert "not UTF-8" in _error(b'{"prompt": "\xed\xa0\x80"}').message  # a surrogate in raw UTF-8 is not UTF-8
    # A pair is one character, fine; so is a backslash before 'ud800'.
    assert decode_json_body(json.dumps({"prompt": "\U0001f600"}).encode()) == {"prompt": "\U0001f600"}
    assert decode_json_body(b'{"prompt": "\\\\ud800"}') == {"prompt": "\\ud800"}


def test_other_bodies() -> None:
    assert decode_json_body(b"\xef\xbb\xbf{}") == {}  # a UTF-8 byte order mark is tolerated
    assert "empty" in _error(b"").message
    assert "not valid JSON" in _error(b"{'a': 1}").message
    assert "not UTF-8" in _error(b"\xff").message
