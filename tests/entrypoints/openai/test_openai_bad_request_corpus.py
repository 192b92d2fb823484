"""A corpus of hostile requests against a running server: malformed and deep
JSON, wrong types, every numeric field out of range or past 64 bits, bad
media, invalid Unicode, prompts and completions longer than the context,
unknown voices.

Each case must get its 4xx in OpenAI's error shape, with a message naming the
problem and ``param`` naming the field at fault. Meanwhile bystander streams
run back to back and must each finish with the text they give alone, and a
normal greedy request after every case must answer exactly what it answered
before the corpus: no bad request may cost another request anything.

The bad media goes to the omni server at the end, whose model takes images and
audio: a text-only model refuses every media part for its modality before
decoding it, so there the decoders would never see these bytes.
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from omnistage.engine.arg_utils import EngineArgs
from omnistage.entrypoints.openai.api_server import ServerOptions, ServerThread, build_app
from omnistage.entrypoints.openai.request_body import MAX_JSON_DEPTH
from omnistage.testing.tiny_omni_checkpoint import write_tiny_qwen2_5_omni

from oai_helpers import TEST_MAX_MODEL_LEN, png_bytes, wav_b64

CHAT = "/v1/chat/completions"
COMPL = "/v1/completions"
USER = [{"role": "user", "content": "hello"}]
GREEDY_CHAT = {"messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 8, "temperature": 0.0}
GREEDY_COMPL = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0.0}
BYSTANDER = {**GREEDY_CHAT, "max_tokens": 48, "ignore_eos": True, "stream": True}
BIG = "9" * 5000  # past Python's 4300-digit int conversion limit
LONG_TEXT = "lorem ipsum dolor sit amet " * 3  # tokenized for the context check: its bytes alone might not fit


def chat(**kw: Any) -> dict[str, Any]:
    return {"messages": USER, "max_tokens": 2, **kw}


def compl(**kw: Any) -> dict[str, Any]:
    return {"prompt": "hello", "max_tokens": 2, **kw}


def raw(obj: dict[str, Any], **tokens: str) -> bytes:
    """``obj`` as JSON with each ``"@name"`` string replaced by the raw text ``tokens[name]``
    (literals json.dumps cannot write: huge integers, NaN)."""
    text = json.dumps(obj)
    for name, token in tokens.items():
        text = text.replace(json.dumps(f"@{name}"), token)
    return text.encode()


def user_parts(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": "look"}, *parts]}]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def data_url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{b64(data)}"


def image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def audio(data: str, fmt: str = "wav") -> dict[str, Any]:
    return {"type": "input_audio", "input_audio": {"data": data, "format": fmt}}


def nested(depth: int) -> Any:
    """Arrays ``depth`` levels deep."""
    value: Any = []
    for _ in range(depth - 1):
        value = [value]
    return value


@dataclass
class Case:
    name: str
    path: str
    body: Any  # dict -> JSON; bytes -> sent as is
    words: str  # must appear in error.message
    param: str | None = None  # None: error.param must be None too
    status: int = 400
    code: str | None = None


def _numeric_cases() -> list[Case]:
    """Every numeric field of both request models: below, above, and far past 64 bits."""
    cases: list[Case] = []
    huge = 10**20
    table: list[tuple[str, str, dict[str, Any], Any, str]] = [
        # (endpoint, field, other fields, value, words)
        (CHAT, "n", {}, 0, "greater than or equal to 1"),
        (COMPL, "n", {}, 129, "less than or equal to 128"),
        (CHAT, "n", {}, huge, "less than or equal to 128"),
        (CHAT, "temperature", {}, -0.5, "greater than or equal to 0"),
        (COMPL, "temperature", {}, 2.5, "less than or equal to 2"),
        (CHAT, "top_p", {}, 0, "greater than 0"),
        (COMPL, "top_p", {}, 1.5, "less than or equal to 1"),
        (CHAT, "min_p", {}, -0.1, "greater than or equal to 0"),
        (COMPL, "min_p", {}, 1.1, "less than or equal to 1"),
        (CHAT, "top_k", {"temperature": 1.0}, huge, "less than or equal to 2147483647"),
        (COMPL, "top_k", {"temperature": 1.0}, huge, "less than or equal to 2147483647"),
        (CHAT, "top_k", {}, -2, "greater than or equal to -1"),
        (CHAT, "seed", {}, 2**63, "less than or equal to 9223372036854775807"),
        (COMPL, "seed", {}, -(2**63) - 1, "greater than or equal to -9223372036854775808"),
        (CHAT, "min_tokens", {"max_tokens": None}, huge, "less than or equal to 2147483647"),
        (COMPL, "min_tokens", {"max_tokens": None}, huge, "less than or equal to 2147483647"),
        (CHAT, "min_tokens", {}, -1, "greater than or equal to 0"),
        (CHAT, "max_tokens", {}, 0, "greater than or equal to 1"),
        (CHAT, "max_tokens", {}, 2**63, "less than or equal to 9223372036854775807"),
        (COMPL, "max_tokens", {}, -3, "greater than or equal to 0"),
        (CHAT, "max_completion_tokens", {}, 0, "greater than or equal to 1"),
        (CHAT, "max_completion_tokens", {}, huge, "less than or equal to 9223372036854775807"),
        (CHAT, "top_logprobs", {"logprobs": True}, 21, "less than or equal to 20"),
        (CHAT, "top_logprobs", {"logprobs": True}, -1, "greater than or equal to 0"),
        (CHAT, "top_logprobs", {"logprobs": True}, huge, "less than or equal to 20"),
        (COMPL, "logprobs", {}, 21, "less than or equal to 20"),
        (COMPL, "logprobs", {}, huge, "less than or equal to 20"),
        (COMPL, "best_of", {}, 0, "greater than or equal to 1"),
        (COMPL, "best_of", {}, huge, "less than or equal to 128"),
        (CHAT, "presence_penalty", {}, 2.5, "less than or equal to 2"),
        (COMPL, "presence_penalty", {}, -2.5, "greater than or equal to -2"),
        (CHAT, "frequency_penalty", {}, -3, "greater than or equal to -2"),
        (COMPL, "frequency_penalty", {}, 1e300, "less than or equal to 2"),
        (CHAT, "repetition_penalty", {}, 0, "greater than or equal to 0.01"),
        (COMPL, "repetition_penalty", {}, -1.0, "greater than or equal to 0.01"),
        (CHAT, "repetition_penalty", {}, 1e30, "less than or equal to 100"),
    ]
    for path, name, others, value, words in table:
        make = chat if path == CHAT else compl
        shown = f"{value:.0e}" if isinstance(value, int) and abs(value) >= 10**6 else repr(value)
        where = "chat" if path == CHAT else "completions"
        cases.append(Case(f"{where} {name}={shown}", path, make(**others, **{name: value}), words, name))
    cases += [
        Case("logit_bias value", CHAT, chat(logit_bias={"5": 101}), "less than or equal to 100", "logit_bias.5"),
        Case("logit_bias value low", COMPL, compl(logit_bias={"5": -1000}), "greater than or equal to -100", "logit_bias.5"),
        Case("stop_token_ids huge", CHAT, chat(stop_token_ids=[1, huge]), "less than or equal to", "stop_token_ids[1]"),
        Case("stop_token_ids negative", COMPL, compl(stop_token_ids=[-1]), "greater than or equal to 0", "stop_token_ids[0]"),
        Case("prompt token id huge", COMPL, compl(prompt=[1, huge]), "token ids", "prompt"),
        # Literals past float64 and past Python's digit limit.
        Case("temperature inf", CHAT, raw(chat(temperature="@x"), x="1e999"), "finite number", "temperature"),
        Case("temperature NaN", COMPL, raw(compl(temperature="@x"), x="NaN"), "finite number", "temperature"),
        Case("top_p -Infinity", CHAT, raw(chat(top_p="@x"), x="-Infinity"), "finite number", "top_p"),
        Case("max_tokens Infinity", CHAT, raw(chat(max_tokens="@x"), x="Infinity"), "valid integer", "max_tokens"),
        Case("max_tokens 5000 digits", CHAT, raw(chat(max_tokens="@x"), x=BIG), "5000 digits", "max_tokens", code="invalid_value"),
        Case("seed 5000 digits", COMPL, raw(compl(seed="@x"), x="-" + BIG), "5000 digits", "seed"),
        Case("token id 5000 digits", COMPL, raw(compl(prompt=[1, "@x"]), x=BIG), "5000 digits", "prompt[1]"),
        Case(
            "5000 digits in a free-form field", CHAT, raw(chat(chat_template_kwargs={"k": ["@x"]}), x=BIG), "5000 digits",
            "chat_template_kwargs.k[0]",
        ),
    ]
    return cases


def _type_cases() -> list[Case]:
    return [
        Case("messages a string", CHAT, {"messages": "hi"}, "valid list", "messages"),
        Case("message a string", CHAT, {"messages": ["hi"]}, "valid dictionary", "messages[0]"),
        Case("content a number", CHAT, chat(messages=[{"role": "user", "content": 5}]), "valid", "messages[0].content"),
        Case("max_tokens a string", CHAT, chat(max_tokens="5"), "valid integer", "max_tokens"),
        Case("max_tokens a bool", COMPL, compl(max_tokens=True), "valid integer", "max_tokens"),
        Case("max_tokens a decimal", CHAT, chat(max_tokens=5.0), "valid integer", "max_tokens"),
        Case("n a list", CHAT, chat(n=[1]), "valid integer", "n"),
        Case("seed a decimal", COMPL, compl(seed=1.5), "valid integer", "seed"),
        Case("top_k a string", CHAT, chat(top_k="5"), "valid integer", "top_k"),
        Case("temperature a string", CHAT, chat(temperature="hot"), "valid number", "temperature"),
        Case("temperature a bool", COMPL, compl(temperature=True), "valid number", "temperature"),
        Case("stream a string", CHAT, chat(stream="yes"), "valid boolean", "stream"),
        Case("logprobs a string", CHAT, chat(logprobs="true"), "valid boolean", "logprobs"),
        Case("stop an object", CHAT, chat(stop={"a": 1}), "valid", "stop"),
        Case("prompt a number", COMPL, compl(prompt=5), "valid", "prompt"),
        Case("prompt of decimals", COMPL, compl(prompt=[1.5, 2]), "valid", "prompt[0]"),
        Case("stop list with a number", COMPL, compl(stop=["a", 1]), "valid string", "stop[1]"),
        Case("token lists with a word", COMPL, compl(prompt=[[1, 2], [3, "x"]]), "valid integer", "prompt[1][1]"),
        Case("stop_token_ids strings", COMPL, compl(stop_token_ids=["a"]), "valid integer", "stop_token_ids[0]"),
        Case("logit_bias value a string", CHAT, chat(logit_bias={"5": "x"}), "valid number", "logit_bias.5"),
        Case("model a number", CHAT, chat(model=5), "valid string", "model"),
        Case("user a list", COMPL, compl(user=["x"]), "valid string", "user"),
        Case("unknown field", COMPL, compl(temprature=1), "Unrecognized request argument", "temprature"),
    ]


def _json_cases() -> list[Case]:
    deep = 100_000
    return [
        Case("truncated", CHAT, b'{"messages": [{"role": "user"', "not valid JSON", code="invalid_json"),
        Case("trailing garbage", CHAT, b'{"messages": []} x', "not valid JSON", code="invalid_json"),
        Case("single quotes", COMPL, b"{'prompt': 'x'}", "not valid JSON", code="invalid_json"),
        Case("a bare string", COMPL, b'"hello"', "JSON object"),
        Case("null", CHAT, b"null", "JSON object"),
        Case("not UTF-8", COMPL, b'{"prompt": "\xff\xfe"}', "not UTF-8", code="invalid_json"),
        Case("UTF-8 encoded surrogate", COMPL, b'{"prompt": "\xed\xa0\x80"}', "not UTF-8", code="invalid_json"),
        Case("arrays 100k deep", CHAT, b"[" * deep + b"]" * deep, "100000 levels deep", code="json_too_deep"),
        Case("objects 50k deep", COMPL, b'{"a":' * 50_000 + b"1" + b"}" * 50_000, "50000 levels deep", code="json_too_deep"),
        Case("deep and unclosed", CHAT, b'{"messages": ' + b"[" * deep, "levels deep", code="json_too_deep"),
        Case(
            "deep inside a field", CHAT, json.dumps(chat(chat_template_kwargs={"k": nested(MAX_JSON_DEPTH)})).encode(),
            f"{MAX_JSON_DEPTH + 2} levels deep", code="json_too_deep",
        ),
        Case("brackets in strings are not depth", CHAT, json.dumps(chat(user="[" * 1000)).encode() + b" x", "not valid JSON"),
    ]


def _unicode_cases() -> list[Case]:
    return [
        Case("lone surrogate prompt", COMPL, compl(prompt="\ud800"), "Invalid Unicode", "prompt", code="invalid_unicode"),
        Case("lone low surrogate in a list", COMPL, compl(prompt=["fine", "x\udc00"]), "U+DC00 at character 1", "prompt[1]"),
        Case("lone surrogate chat content", CHAT, chat(messages=[{"role": "user", "content": "hi \ud800"}]),
             "Invalid Unicode", "messages[0].content", code="invalid_unicode"),
        Case("lone surrogate text part", CHAT, chat(messages=user_parts({"type": "text", "text": "\udfff"})),
             "Invalid Unicode", "messages[0].content[1].text"),
        Case("lone surrogate stop", CHAT, chat(stop=["ok", "\ud83d"]), "Invalid Unicode", "stop[1]"),
        Case("lone surrogate key", CHAT, chat(chat_template_kwargs={"\ud800": 1}), "a key of", "chat_template_kwargs"),
    ]


def _media_cases() -> list[Case]:
    p = "messages[0].content[1]"
    return [
        Case("image not an image", CHAT, chat(messages=user_parts(image(data_url("image/png", b"hello")))), "image",
             f"{p}.image_url.url", code="invalid_image"),
        Case("image truncated png", CHAT, chat(messages=user_parts(image(data_url("image/png", png_bytes(8, 8)[:40])))), "image",
             f"{p}.image_url.url", code="invalid_image"),
        Case("image bad base64", CHAT, chat(messages=user_parts(image("data:image/png;base64,%%%"))), "base64", f"{p}.image_url.url"),
        Case("data url without comma", CHAT, chat(messages=user_parts(image("data:image/png;base64"))), "data URL", f"{p}.image_url.url"),
        Case("data url not base64", CHAT, chat(messages=user_parts(image("data:image/png,abc"))), "base64", f"{p}.image_url.url"),
        Case("data url wrong media type", CHAT, chat(messages=user_parts(image("data:text/plain;base64,aGk="))), "text/plain",
             f"{p}.image_url.url"),
        Case("image url scheme", CHAT, chat(messages=user_parts(image("ftp://x/y.png"))), "ftp", f"{p}.image_url.url"),
        Case("audio not wav", CHAT, chat(messages=user_parts(audio(base64.b64encode(b"OggS" + b"\0" * 40).decode()))), "WAV",
             f"{p}.input_audio.data"),
        Case("audio truncated wav", CHAT, chat(messages=user_parts(audio(b64(base64.b64decode(wav_b64(0.05))[:30])))), "WAV",
             f"{p}.input_audio.data", code="invalid_audio"),
        Case("audio empty", CHAT, chat(messages=user_parts(audio(""))), "at least 1 character", f"{p}.input_audio.data"),
        Case("audio format", CHAT, chat(messages=user_parts(audio(wav_b64(), "ogg"))), "'wav'", f"{p}.input_audio.format"),
    ]


def _context_cases() -> list[Case]:
    room = "leaves room for at most"
    return [
        Case("chat max_tokens 1e12", CHAT, chat(max_tokens=10**12), room, "max_tokens", code="context_length_exceeded"),
        Case("chat max_completion_tokens 1e12", CHAT, chat(max_completion_tokens=10**12), room, "max_completion_tokens"),
        Case("chat max_tokens = max_model_len", CHAT, chat(max_tokens=TEST_MAX_MODEL_LEN), "'max_tokens' is too large", "max_tokens"),
        Case("chat min_tokens past context", CHAT, chat(max_tokens=None, min_tokens=TEST_MAX_MODEL_LEN), room, "min_tokens"),
        Case("completions max_tokens 1e12", COMPL, compl(max_tokens=10**12), room, "max_tokens"),
        Case("completions n=3 max_tokens 1e12", COMPL, compl(max_tokens=10**12, n=3), room, "max_tokens"),
        Case("token prompt max_tokens", COMPL, compl(prompt=list(range(1, 200)), max_tokens=100), "takes 199", "max_tokens"),
        Case("long text prompt max_tokens", COMPL, compl(prompt=LONG_TEXT, max_tokens=TEST_MAX_MODEL_LEN - 20), room, "max_tokens"),
        Case("chat prompt over context", CHAT, chat(messages=[{"role": "user", "content": "hello world " * 400}]),
             "max_model_len", "messages", code="context_length_exceeded"),
        Case("token prompt over context", COMPL, compl(prompt=list(range(1, 300))), "max_model_len", "prompt"),
        Case("second prompt over context", COMPL, compl(prompt=["fine", "hello world " * 400]), "max_model_len", "prompt[1]"),
    ]


CASES = _json_cases() + _type_cases() + _numeric_cases() + _unicode_cases() + _context_cases()  # text-only server

# Values at the edges of the bounds above, which must be accepted (200).
ACCEPTED: list[tuple[str, str, dict[str, Any]]] = [
    ("top_k at int32 max", CHAT, chat(top_k=2**31 - 1, temperature=1.0, seed=1)),
    ("seed at int64 max with n=2", COMPL, compl(seed=2**63 - 1, n=2, temperature=1.0)),
    ("seed at int64 min", CHAT, chat(seed=-(2**63), temperature=1.0)),
    ("penalties in range", CHAT, chat(presence_penalty=1.5, frequency_penalty=-2.0, repetition_penalty=1.3)),
    ("repetition_penalty bounds", COMPL, compl(repetition_penalty=0.01)),
    ("min_tokens filling the room", COMPL, compl(prompt=[1, 2, 3], max_tokens=None, min_tokens=TEST_MAX_MODEL_LEN - 3)),
    ("max_tokens filling the room", COMPL, compl(prompt=[1, 2, 3], max_tokens=TEST_MAX_MODEL_LEN - 3)),
    ("surrogate pair", CHAT, chat(messages=[{"role": "user", "content": "smile \ud83d\ude00"}])),
    ("nesting at the limit", CHAT, chat(chat_template_kwargs={"k": nested(MAX_JSON_DEPTH - 2)})),
]


# --------------------------------------------------------------------------- machinery


def send(http: httpx.Client, path: str, body: Any, model: str) -> httpx.Response:
    # json.dumps escapes non-ASCII, so lone surrogates travel as \ud800 (httpx's json= cannot encode them).
    content = body if isinstance(body, bytes) else json.dumps({"model": model, **body}).encode()
    return http.post(path, content=content, headers={"content-type": "application/json"})


def check_error(resp: httpx.Response, case: Case) -> str | None:
    """What is wrong with the answer to ``case``; None when it is right."""
    if resp.status_code != case.status:
        return f"status {resp.status_code}, expected {case.status}: {resp.text[:300]}"
    try:
        err = resp.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"not an OpenAI error body: {resp.text[:300]}"
    if set(err) != {"message", "type", "param", "code"} or err["type"] != "invalid_request_error":
        return f"error shape {err}"
    if case.words not in err["message"]:
        return f"message lacks {case.words!r}: {err['message'][:300]}"
    if err["param"] != case.param:
        return f"param {err['param']!r}, expected {case.param!r} ({err['message'][:200]})"
    if case.code is not None and err["code"] != case.code:
        return f"code {err['code']!r}, expected {case.code!r}"
    return None


def greedy_texts(http: httpx.Client, model: str) -> tuple[str, str]:
    a = send(http, CHAT, GREEDY_CHAT, model)
    b = send(http, COMPL, GREEDY_COMPL, model)
    assert a.status_code == 200 and b.status_code == 200, (a.text, b.text)
    return a.json()["choices"][0]["message"]["content"], b.json()["choices"][0]["text"]


def stream_text(http: httpx.Client, model: str, body: dict[str, Any]) -> tuple[str, str | None, bool]:
    """(text, finish reason, saw [DONE]) of one streamed chat completion; raises on an error event."""
    text, finish, done = "", None, False
    with http.stream("POST", CHAT, json={"model": model, **body}) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                break
            obj = json.loads(data)
            if "error" in obj:
                raise AssertionError(f"bystander stream got an error event: {obj}")
            for choice in obj["choices"]:
                text += choice["delta"].get("content") or ""
                finish = choice["finish_reason"] or finish
    return text, finish, done


class Bystanders:
    """Streams run back to back in a thread for as long as the corpus runs."""

    def __init__(self, base_url: str, model: str, body: dict[str, Any]) -> None:
        self.base_url, self.model, self.body = base_url, model, body
        self.results: list[tuple[str, str | None, bool]] = []
        self.failures: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=60) as http:
            while not self.stop.is_set():
                try:
                    self.results.append(stream_text(http, self.model, self.body))
                except Exception as exc:  # noqa: BLE001 - reported by the test
                    self.failures.append(repr(exc))

    def __enter__(self) -> Bystanders:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(60)


def run_corpus(http: httpx.Client, base_url: str, model: str, cases: list[Case], bystander: dict[str, Any]) -> None:
    chat_ref, compl_ref = greedy_texts(http, model)
    alone = stream_text(http, model, bystander)
    assert alone[1] == "length" and alone[2], alone
    failures: list[str] = []
    with Bystanders(base_url, model, bystander) as others:
        for case in cases:  # every case runs, so a failure lists all that went wrong, not the first
            try:
                problem = check_error(send(http, case.path, case.body, model), case)
            except httpx.HTTPError as exc:
                problem = f"no answer: {exc!r}"
            if problem:
                failures.append(f"{case.name}: {problem}")
            try:
                after: Any = greedy_texts(http, model)
            except (AssertionError, httpx.HTTPError) as exc:
                after = exc
            if after != (chat_ref, compl_ref):
                failures.append(f"{case.name}: the greedy request after it answered {str(after)[:200]}")
    assert not failures, "\n".join(failures)
    assert not others.failures, others.failures
    assert others.results, "no bystander stream ran"
    for result in others.results:
        assert result == alone, f"a bystander stream ended as {result}, alone it gives {alone}"


# --------------------------------------------------------------------------- tests


def test_corpus_gets_4xx_and_hurts_no_one(server, http: httpx.Client) -> None:
    run_corpus(http, server.base_url, server.model, CASES, BYSTANDER)
    stats = server.wait_idle()
    assert stats.kv_blocks_used == 0 and stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0
    assert http.get("/health").json() == {"status": "ok"}


@pytest.mark.parametrize("name, path, body", ACCEPTED, ids=[a[0] for a in ACCEPTED])
def test_values_at_the_edges_are_accepted(server, http: httpx.Client, name: str, path: str, body: dict[str, Any]) -> None:
    resp = send(http, path, body, server.model)
    assert resp.status_code == 200, resp.text


def test_tiny_temperature_is_greedy(server, http: httpx.Client) -> None:
    """1e-30 divides float32 logits into overflow; it is greedy, as the limit says it is."""
    greedy = greedy_texts(http, server.model)
    resp = send(http, CHAT, {**GREEDY_CHAT, "temperature": 1e-30, "seed": 3}, server.model)
    assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"] == greedy[0]


def test_long_text_prompt_is_tokenized_for_the_check(server, http: httpx.Client) -> None:
    """The long-text case above must fail for its tokens, not for its bytes: it fits with fewer."""
    body = compl(prompt=LONG_TEXT)
    prompt_tokens = send(http, COMPL, {**body, "max_tokens": 1}, server.model).json()["usage"]["prompt_tokens"]
    assert 20 < prompt_tokens < len(LONG_TEXT.encode())  # the case above is refused for its tokens; bytes would refuse more
    fits = TEST_MAX_MODEL_LEN - prompt_tokens
    assert send(http, COMPL, {**body, "max_tokens": fits}, server.model).status_code == 200
    assert send(http, COMPL, {**body, "max_tokens": fits + 1}, server.model).status_code == 400


# --------------------------------------------------------------------------- omni server (speech, media in)

OMNI_NAME = "tiny-omni-corpus"
OMNI_CASES = [
    Case("unknown voice", CHAT, chat(modalities=["text", "audio"], audio={"voice": "Nobody", "format": "wav"}),
         "Unknown voice 'Nobody'", "audio.voice", code="unknown_voice"),
    Case("empty voice", CHAT, chat(modalities=["text", "audio"], audio={"voice": "", "format": "wav"}),
         "at least 1 character", "audio.voice"),
    Case("voice not a string", CHAT, chat(modalities=["text", "audio"], audio={"voice": 3, "format": "wav"}),
         "valid string", "audio.voice"),
    Case("unknown audio format", CHAT, chat(modalities=["text", "audio"], audio={"voice": "Ethan", "format": "ogg"}),
         "'wav'", "audio.format"),
    Case("top_k past 64 bits", CHAT, chat(top_k=10**20, temperature=1.0, max_tokens=4), "less than or equal to", "top_k"),
    Case("min_tokens past 64 bits", CHAT, chat(min_tokens=10**20, max_tokens=None), "less than or equal to", "min_tokens"),
    Case("max_tokens 1e12", CHAT, chat(max_tokens=10**12), "leaves room for at most", "max_tokens"),
    Case("lone surrogate", CHAT, chat(messages=[{"role": "user", "content": "\ud800"}]), "Invalid Unicode", "messages[0].content"),
    *_media_cases(),  # this model takes images and audio, so the media is decoded
]


@pytest.fixture(scope="module")
def omni_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder: Path = write_tiny_qwen2_5_omni(tmp_path_factory.mktemp("tiny_omni_corpus"))
    engine = EngineArgs(model=str(folder), block_size=4, max_model_len=TEST_MAX_MODEL_LEN, num_kv_blocks=256, max_num_seqs=8)
    app = build_app(engine, ServerOptions(served_model_names=[OMNI_NAME], talker_params={"temperature": 0.0, "max_tokens": 8}))
    thread = ServerThread(app).start()
    try:
        yield thread.base_url
    finally:
        thread.stop()


def test_omni_corpus_gets_4xx_and_hurts_no_one(omni_server: str) -> None:
    bystander = {**BYSTANDER, "max_tokens": 16}
    with httpx.Client(base_url=omni_server, timeout=60) as http:
        run_corpus(http, omni_server, OMNI_NAME, OMNI_CASES, bystander)
        assert http.get("/health").json() == {"status": "ok"}
