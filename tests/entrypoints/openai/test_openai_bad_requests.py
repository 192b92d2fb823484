"""Table of bad requests: each gets its 4xx with an OpenAI error body naming the
problem, and a good request still succeeds right after it.

Most cases go to the text-only tiny model. Media that cannot be decoded goes
to a model that takes that media (conftest's ``media_server``): a text-only
model refuses every image or audio part for its modality before decoding it,
whatever its bytes (cases "... on text model")."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import pytest
from oai_helpers import (
    TEST_MAX_BODY_BYTES,
    TEST_MAX_MODEL_LEN,
    TINY_MEDIA_MODEL_NAME,
    TINY_MODEL_NAME,
    png_data_url,
    wav_b64,
    wav_bytes,
)

CHAT = "/v1/chat/completions"
COMPL = "/v1/completions"
USER = [{"role": "user", "content": "hello"}]


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": TINY_MODEL_NAME, "messages": USER, "max_tokens": 2, **kw}


def media_chat(**kw: Any) -> dict[str, Any]:
    """A chat body for conftest's ``media_server``, whose model takes images and audio."""
    return chat(model=TINY_MEDIA_MODEL_NAME, **kw)


def compl(**kw: Any) -> dict[str, Any]:
    return {"model": TINY_MODEL_NAME, "prompt": "hello", "max_tokens": 2, **kw}


def user_parts(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": "look"}, *parts]}]


def image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def audio(data: str, fmt: str = "wav") -> dict[str, Any]:
    return {"type": "input_audio", "input_audio": {"data": data, "format": fmt}}


@dataclass
class Case:
    name: str
    path: str
    body: Any  # dict -> JSON; bytes -> sent raw
    status: int
    words: str  # must appear in error.message
    param: str | None = None
    code: str | None = None
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=dict)
    server: str = "server"  # the fixture of the server it goes to: "server" (text only) or "media_server"


LONG_IDS = list(range(1, 300))  # > TEST_MAX_MODEL_LEN tokens
assert len(LONG_IDS) > TEST_MAX_MODEL_LEN

CASES = [
    Case("malformed json", CHAT, b'{"model": "x", "messages": [', 400, "not valid JSON", code="invalid_json"),
    Case("empty body", CHAT, b"", 400, "empty", code="invalid_json"),
    Case("json array body", CHAT, b"[1, 2]", 400, "JSON object"),
    Case("not utf8", CHAT, b"\xff\xfe\x00", 400, "not valid JSON"),
    Case("unknown model", CHAT, chat(model="gpt-9"), 404, "gpt-9", "model", "model_not_found"),
    Case("unknown model completions", COMPL, compl(model="nope"), 404, "nope", "model", "model_not_found"),
    Case("missing messages", CHAT, {"model": TINY_MODEL_NAME}, 400, "Missing required parameter", "messages"),
    Case("invalid role", CHAT, chat(messages=[{"role": "robot", "content": "x"}]), 400, "robot", "messages[0].role"),
    Case("null content", CHAT, chat(messages=[{"role": "user", "content": None}]), 400, "content is required", "messages[0].content"),
    Case(
        "unknown part type", CHAT, chat(messages=user_parts({"type": "video_url", "video_url": {}})), 400,
        "video_url", "messages[0].content[1].type", "invalid_content_part",
    ),
    Case(
        "part missing field", CHAT, chat(messages=user_parts({"type": "text"})), 400, "Missing", "messages[0].content[1].text",
    ),
    Case(
        "image bad base64", CHAT, media_chat(messages=user_parts(image("data:image/png;base64,!!!!"))), 400, "invalid base64",
        "messages[0].content[1].image_url.url", "invalid_base64", server="media_server",
    ),
    Case(
        "image not an image", CHAT,
        media_chat(messages=user_parts(image("data:image/png;base64," + base64.b64encode(b"hello").decode()))), 400,
        "could not decode image", "messages[0].content[1].image_url.url", "invalid_image", server="media_server",
    ),
    Case(
        "image too many pixels", CHAT, media_chat(messages=user_parts(image(png_data_url(100, 100)))), 400, "100x100",
        "messages[0].content[1].image_url.url", "image_too_large", server="media_server",
    ),
    Case(
        "remote image url", CHAT, media_chat(messages=user_parts(image("https://example.com/x.png"))), 400, "remote",
        "messages[0].content[1].image_url.url", "remote_url_not_allowed", server="media_server",
    ),
    Case(
        "local path escaping root", CHAT, media_chat(messages=user_parts(image("file:///etc/passwd"))), 400, "outside",
        "messages[0].content[1].image_url.url", "path_not_allowed", server="media_server",
    ),
    Case(
        "local path with dotdot", CHAT, media_chat(messages=user_parts(image("file:///tmp/../etc/passwd"))), 400, "'..'",
        "messages[0].content[1].image_url.url", "path_not_allowed", server="media_server",
    ),
    Case(
        "valid image on text model", CHAT, chat(messages=user_parts(image(png_data_url(8, 8)))), 400,
        "does not accept image input", "messages[0].content[1]", "unsupported_modality",
    ),
    Case(
        "image in system message", CHAT,
        chat(messages=[{"role": "system", "content": [image(png_data_url(8, 8))]}, *USER]), 400,
        "only user messages", "messages[0].content[0]",
    ),
    Case(
        "audio bad base64", CHAT, media_chat(messages=user_parts(audio("#$%^"))), 400, "invalid base64",
        "messages[0].content[1].input_audio.data", "invalid_base64", server="media_server",
    ),
    Case(
        "audio not wav", CHAT, media_chat(messages=user_parts(audio(base64.b64encode(b"OggS....").decode()))), 400, "not a WAV",
        "messages[0].content[1].input_audio.data", "invalid_audio", server="media_server",
    ),
    Case(
        "audio too long", CHAT,
        media_chat(messages=user_parts(audio(base64.b64encode(wav_bytes(np.zeros(16000 * 2), 16000)).decode()))), 400,
        "2.0 s", "messages[0].content[1].input_audio.data", "audio_too_long", server="media_server",
    ),
    Case(
        "audio mp3", CHAT, media_chat(messages=user_parts(audio(wav_b64(), "mp3"))), 400, "mp3",
        "messages[0].content[1].input_audio.format", "unsupported_audio_format", server="media_server",
    ),
    Case(
        "valid audio on text model", CHAT, chat(messages=user_parts(audio(wav_b64(0.1)))), 400, "does not accept audio input",
        "messages[0].content[1]", "unsupported_modality",
    ),
    # Issue 12: what the model takes is checked before the part is decoded, so
    # bytes no decoder reads still get the modality error, naming the part.
    Case(
        "undecodable image on text model", CHAT, chat(messages=user_parts(image("data:image/png;base64,!!!!"))), 400,
        "does not accept image input", "messages[0].content[1]", "unsupported_modality",
    ),
    Case(
        "not-a-WAV audio on text model", CHAT, chat(messages=user_parts(audio(base64.b64encode(b"OggS....").decode()))), 400,
        "does not accept audio input", "messages[0].content[1]", "unsupported_modality",
    ),
    Case(
        "mp3 audio on text model", CHAT, chat(messages=user_parts(audio(wav_b64(), "mp3"))), 400,
        "does not accept audio input", "messages[0].content[1]", "unsupported_modality",
    ),
    Case("audio output on text model", CHAT, chat(modalities=["audio"]), 400, "cannot produce", "modalities", "unsupported_modality"),
    Case("audio params without modality", CHAT, chat(audio={"voice": "x", "format": "wav"}), 400, "modalities", "audio"),
    Case(
        "chat prompt too long", CHAT, chat(messages=[{"role": "user", "content": "hello world " * 400}]), 400, "max_model_len",
        "messages", "context_length_exceeded",
    ),
    Case(
        "max_tokens beyond the context", CHAT, chat(max_tokens=10**12), 400, "leaves room for at most", "max_tokens",
        "context_length_exceeded",
    ),
    Case("completions max_tokens 0 without echo", COMPL, compl(max_tokens=0), 400, "needs 'echo'", "max_tokens"),
    Case("max_tokens 0 with min_tokens", COMPL, compl(max_tokens=0, echo=True, min_tokens=2), 400, "min_tokens", "min_tokens"),
    Case("completions max_tokens beyond the context", COMPL, compl(max_tokens=10**12), 400, "max_model_len", "max_tokens"),
    Case("min_tokens beyond the context", COMPL, compl(max_tokens=None, min_tokens=10**6), 400, "min_tokens", "min_tokens"),
    Case("token prompt too long", COMPL, compl(prompt=LONG_IDS), 400, "max_model_len", "prompt", "context_length_exceeded"),
    Case("token id out of vocab", COMPL, compl(prompt=[1, 2, 10**9]), 400, "token ids", "prompt"),
    Case("second prompt bad", COMPL, compl(prompt=["fine", ""]), 400, "empty", "prompt[1]"),
    Case("empty prompt list", COMPL, compl(prompt=[]), 400, "empty", "prompt"),
    Case("empty cache_salt", CHAT, chat(cache_salt=""), 400, "at least 1 character", "cache_salt"),
    Case("cache_salt not a string", COMPL, compl(cache_salt=5), 400, "string", "cache_salt"),
    Case("temperature too high", CHAT, chat(temperature=5), 400, "less than or equal to 2", "temperature"),
    Case("top_p zero", CHAT, chat(top_p=0), 400, "greater than 0", "top_p"),
    Case("n zero", COMPL, compl(n=0), 400, "greater than or equal to 1", "n"),
    Case("max_tokens negative", CHAT, chat(max_tokens=-1), 400, "greater than or equal to 1", "max_tokens"),
    Case("top_logprobs too many", CHAT, chat(logprobs=True, top_logprobs=50), 400, "20", "top_logprobs"),
    Case("top_logprobs without logprobs", CHAT, chat(top_logprobs=2), 400, "requires 'logprobs'", "top_logprobs"),
    Case("completion logprobs too many", COMPL, compl(logprobs=99), 400, "20", "logprobs"),
    Case("min_tokens over max_tokens", CHAT, chat(min_tokens=5), 400, "min_tokens", "min_tokens"),
    Case("empty stop string", CHAT, chat(stop=[""]), 400, "stop", "stop"),
    Case("stop wrong type", CHAT, chat(stop=5), 400, "valid", "stop"),
    Case("seed out of int64", CHAT, chat(seed=2**64), 400, "less than or equal to", "seed"),
    Case("stream_options without stream", CHAT, chat(stream_options={"include_usage": True}), 400, "stream", "stream_options"),
    Case("unknown parameter", CHAT, chat(temprature=0.1), 400, "Unrecognized request argument", "temprature", "unrecognized_argument"),
    Case("tools unsupported", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tool", "tools"),
    Case("penalty out of range", CHAT, chat(presence_penalty=2.5), 400, "less than or equal to 2", "presence_penalty"),
    Case("logit_bias key not a token id", CHAT, chat(logit_bias={"five": 1.0}), 400, "'five'", "logit_bias"),
    Case("logit_bias id out of vocab", COMPL, compl(logit_bias={"5": 1.0, str(10**9): 2.0}), 400, "vocabulary", "logit_bias"),
    Case("suffix unsupported", COMPL, compl(suffix="x"), 400, "suffix", "suffix"),
    Case("body too large", CHAT, b"{" + b" " * (TEST_MAX_BODY_BYTES + 10) + b"}", 413, "exceeds the limit", code="request_too_large"),
    Case("wrong method", CHAT, None, 405, "Method Not Allowed", method="GET"),
    Case("unknown route", "/v1/nothing", {}, 404, "Not Found"),
]


def _send(http: httpx.Client, case: Case) -> httpx.Response:
    if case.method == "GET":
        return http.get(case.path)
    if isinstance(case.body, bytes):
        return http.post(case.path, content=case.body, headers={"content-type": "application/json", **case.headers})
    return http.post(case.path, json=case.body, headers=case.headers)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_request(request: pytest.FixtureRequest, case: Case) -> None:
    server = request.getfixturevalue(case.server)  # the media server starts only when a case needs it
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        resp = _send(http, case)
        assert resp.status_code == case.status, resp.text
        err = resp.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert case.words in err["message"], err
        if case.param is not None:
            assert err["param"] == case.param, err
        if case.code is not None:
            assert err["code"] == case.code, err
        # The server keeps serving.
        good = http.post(CHAT, json=chat(model=server.model))
        assert good.status_code == 200, good.text
        assert good.json()["choices"][0]["message"]["content"] is not None


def test_chunked_body_over_limit(server, http: httpx.Client) -> None:
    """A chunked body declares no length; the limit still holds while reading."""

    def gen():
        for _ in range(TEST_MAX_BODY_BYTES // 65536 + 2):
            yield b" " * 65536

    resp = http.post(CHAT, content=gen(), headers={"content-type": "application/json"})
    assert resp.status_code == 413
    assert http.post(CHAT, json=chat()).status_code == 200


def test_errors_counted_and_engine_clean(server, http: httpx.Client) -> None:
    http.post(CHAT, content=b"{nope")
    text = http.get("/metrics").text
    assert 'omnistage:requests_total{endpoint="chat",outcome="client_error"}' in text
    stats = server.wait_idle()
    assert stats.kv_blocks_used == 0
    assert json.loads(http.get("/health").text)["status"] == "ok"
