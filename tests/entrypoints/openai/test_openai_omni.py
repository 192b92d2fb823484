"""Speech out of the OpenAI server on a whole omni checkpoint (thinker, talker,
token2wav): the WAV it returns is the offline ``LLM``'s streamed answer
(``generate_stream``: the vocoder's streaming chunks, which the server always
decodes) for the same prompt and settings, streamed or not; text-only requests
skip the talker; bad audio settings are 400s that leave the server serving."""

from __future__ import annotations

import base64
import io
import json
import time
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from omnistage.engine.arg_utils import EngineArgs
from omnistage import LLM
from omnistage.entrypoints.openai import serving_chat
from omnistage.entrypoints.openai.api_server import ServerOptions, ServerThread, build_app
from omnistage.testing.tiny_omni_checkpoint import write_tiny_qwen2_5_omni
from omnistage.multimodal.media import encode_pcm16
from omnistage.outputs import RequestOutput
from omnistage.sampling_params import SamplingParams

from oai_helpers import png_bytes

pytest.importorskip("transformers")

NAME = "tiny-omni-speech"
ENGINE = {"block_size": 4, "max_model_len": 256, "num_kv_blocks": 256, "max_num_seqs": 8}
TALKER = {"temperature": 0.0, "max_tokens": 8}  # greedy and short: a few hundred ms of audio
MESSAGES = [{"role": "user", "content": "Say something nice."}]
SEED, MAX_TOKENS, VOICE = 7, 8, "Ethan"


@pytest.fixture(scope="module")
def omni_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen2_5_omni(tmp_path_factory.mktemp("tiny_omni_server"))


@pytest.fixture(scope="module")
def omni_server(omni_dir: Path) -> Iterator[tuple[ServerThread, Any]]:
    # No engine factory: the server must recognize the omni folder itself, as `omnistage serve` does.
    app = build_app(EngineArgs(model=str(omni_dir), **ENGINE), ServerOptions(served_model_names=[NAME], talker_params=TALKER))
    thread = ServerThread(app).start()
    try:
        yield thread, app
    finally:
        thread.stop()


@pytest.fixture(scope="module")
def offline(omni_dir: Path) -> LLM:
    return LLM(str(omni_dir), talker_params=TALKER, **ENGINE)


@pytest.fixture(scope="module")
def reference(offline: LLM) -> RequestOutput:
    """The offline pipeline's answer, with audio, for the same prompt and settings."""
    (out,) = offline.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, seed=SEED), speaker=VOICE)
    assert out.audio is not None and out.audio.size > 0 and out.sample_rate == 24000
    return out


def streamed_answer(llm: LLM, messages: list[dict[str, Any]]) -> RequestOutput:
    """The offline pipeline's answer with its audio decoded in streaming chunks, as the server decodes it."""
    prompt = llm.llm_engine.encode_chat(messages)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, seed=SEED)
    (final,) = [e.output for e in llm.generate_stream(prompt, params, speaker=VOICE) if e.finished]
    return final


@pytest.fixture(scope="module")
def served(offline: LLM, reference: RequestOutput) -> RequestOutput:
    out = streamed_answer(offline, MESSAGES)
    assert out.outputs[0].text == reference.outputs[0].text
    assert out.extra["codec_token_ids"] == reference.extra["codec_token_ids"]
    return out


@pytest.fixture
def client(omni_server: tuple[ServerThread, Any]) -> Iterator[openai.OpenAI]:
    thread, app = omni_server
    with openai.OpenAI(base_url=thread.base_url + "/v1", api_key="unused", max_retries=0) as c:
        yield c
    _assert_pipeline_empty(app)


def _assert_pipeline_empty(app: Any, timeout: float = 15.0) -> None:
    """Every stage drops its last rows one step after a request ends: poll."""
    client = app.state.engine_client
    deadline = time.monotonic() + timeout
    while True:
        held = client.call_sync(lambda e: e.held())
        if all(h.is_empty for h in held.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert all(h.is_empty for h in held.values()), {k: v for k, v in held.items() if not v.is_empty}


def _record_request_ids(stage: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Ids of the requests ``stage.add_request`` receives from now on (called on the engine thread)."""
    ids: list[str] = []
    real_add = stage.add_request

    def add_request(request_id: str, *args: Any, **kwargs: Any) -> None:
        ids.append(request_id)
        real_add(request_id, *args, **kwargs)

    monkeypatch.setattr(stage, "add_request", add_request)
    return ids


def _request(**extra: Any) -> dict[str, Any]:
    return {
        "model": NAME,
        "messages": MESSAGES,
        "max_completion_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "seed": SEED,
        **extra,
    }


SPEAK = {"modalities": ["text", "audio"], "audio": {"voice": VOICE, "format": "wav"}}


def _pcm(wav_data: bytes) -> np.ndarray:
    """The samples of a 24 kHz mono 16-bit WAV file (a streamed one: sizes unknown, PCM to the end)."""
    if wav_data[4:8] == b"\xff\xff\xff\xff":
        assert wav_data[:4] == b"RIFF" and wav_data[36:44] == b"data\xff\xff\xff\xff"
        wav_data = wav_data[:40] + (len(wav_data) - 44).to_bytes(4, "little") + wav_data[44:]
    with wave.open(io.BytesIO(wav_data)) as f:
        assert (f.getframerate(), f.getnchannels(), f.getsampwidth()) == (24000, 1, 2)
        return np.frombuffer(f.readframes(f.getnframes()), dtype="<i2")


def _assert_same_audio(wav_data: bytes, ref: RequestOutput) -> None:
    """The file's samples are the reference's waveform as the server encodes it (clipped, x32767, rounded)."""
    got = _pcm(wav_data)
    want = np.frombuffer(encode_pcm16(ref.audio), dtype="<i2")
    assert got.shape == want.shape and np.array_equal(got, want)


def test_audio_answer_is_the_offline_pipelines(
    client: openai.OpenAI, reference: RequestOutput, served: RequestOutput
) -> None:
    completion = client.chat.completions.create(**_request(**SPEAK))
    message = completion.choices[0].message
    assert message.content == reference.outputs[0].text
    assert completion.choices[0].finish_reason == reference.outputs[0].finish_reason
    assert message.audio is not None and message.audio.id and message.audio.transcript == message.content
    _assert_same_audio(base64.b64decode(message.audio.data), served)
    assert completion.usage.completion_tokens == len(reference.outputs[0].token_ids)


def test_streamed_audio_follows_the_text(
    client: openai.OpenAI, reference: RequestOutput, served: RequestOutput, omni_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(serving_chat, "AUDIO_CHUNK_BYTES", 3 * 333)  # several pieces even for short audio
    # The stream sends the newest output it has: a tiny thinker can finish before the
    # server reads its first output (it did on a loaded CI machine), so pace its steps.
    thinker = omni_server[1].state.engine_client.engine.stages["thinker"]
    real_step = thinker.step
    monkeypatch.setattr(thinker, "step", lambda: time.sleep(0.02) or real_step())  # the engine thread only
    chunks = list(client.chat.completions.create(**_request(**SPEAK), stream=True))
    choices = [c.choices[0] for c in chunks if c.choices]
    texts = [ch.delta.content for ch in choices if ch.delta.content]
    audio = [(i, ch.delta.audio) for i, ch in enumerate(choices) if ch.delta.audio is not None]
    finish = [i for i, ch in enumerate(choices) if ch.finish_reason is not None]
    assert "".join(texts) == reference.outputs[0].text
    assert len(texts) > 1  # the thinker's progress streams; it does not arrive in one piece at the end
    assert len(audio) > 1 and finish == [len(choices) - 1] and audio[-1][0] < finish[0]
    last_text = max(i for i, ch in enumerate(choices) if ch.delta.content)
    assert last_text < audio[0][0]  # text, then audio, then the finish chunk
    assert audio[0][1].transcript == reference.outputs[0].text and len({a.id for _, a in audio}) == 1
    streamed = b"".join(base64.b64decode(a.data) for _, a in audio)
    assert streamed[:4] == b"RIFF" and streamed[4:8] == b"\xff\xff\xff\xff"  # one header, of unknown length
    assert streamed.count(b"RIFF") == 1
    _assert_same_audio(streamed, served)
    assert choices[-1].finish_reason == reference.outputs[0].finish_reason


def test_disconnect_while_speaking_frees_every_stage(
    client: openai.OpenAI, reference: RequestOutput, omni_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that leaves once the text is complete (its request now in the talker
    or token2wav) aborts it there: the client fixture then finds every stage empty."""
    thread, app = omni_server
    pipeline = app.state.engine_client.engine
    talker, token2wav = pipeline.stages["talker"], pipeline.stages["token2wav"]
    entered = _record_request_ids(talker, monkeypatch)
    vocoded = _record_request_ids(token2wav, monkeypatch)
    real_step = talker.step

    def slow_step() -> Any:
        time.sleep(0.05)  # a talker slow enough that the disconnect lands while it speaks
        return real_step()

    monkeypatch.setattr(talker, "step", slow_step)  # called on the engine thread only
    text = ""
    with httpx.Client(base_url=thread.base_url, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions", json={**_request(**SPEAK), "stream": True}) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        text += choice["delta"].get("content") or ""
                if text == reference.outputs[0].text:
                    break  # leave before the audio arrives
    assert text == reference.outputs[0].text
    deadline = time.monotonic() + 15
    while not entered and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(entered) == 1  # it did reach the talker ...
    _assert_pipeline_empty(app)
    assert vocoded == []  # ... and was aborted there, never reaching token2wav


def test_text_only_request_skips_the_talker(
    client: openai.OpenAI, reference: RequestOutput, omni_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    talker = omni_server[1].state.engine_client.engine.stages["talker"]
    spoken = _record_request_ids(talker, monkeypatch)
    completion = client.chat.completions.create(**_request())
    message = completion.choices[0].message
    assert message.content == reference.outputs[0].text and message.audio is None
    streamed = list(client.chat.completions.create(**_request(modalities=["text"]), stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == reference.outputs[0].text
    assert all(c.choices[0].delta.audio is None for c in streamed if c.choices)
    assert spoken == []
    client.chat.completions.create(**_request(**SPEAK))
    assert len(spoken) == 1  # the check above would have seen a talker request


def test_image_in_speech_out(client: openai.OpenAI, offline: LLM) -> None:
    """Media parts still reach the thinker, and the talker speaks an answer to them."""
    png = base64.b64encode(png_bytes(56, 56, (10, 200, 30))).decode()
    content = [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}},
        {"type": "text", "text": "What is this?"},
    ]
    messages = [{"role": "user", "content": content}]
    completion = client.chat.completions.create(**{**_request(**SPEAK), "messages": messages})
    ref = streamed_answer(offline, messages)
    assert completion.usage.prompt_tokens == len(ref.prompt_token_ids) > 100  # image placeholders expanded
    assert completion.choices[0].message.content == ref.outputs[0].text
    _assert_same_audio(base64.b64decode(completion.choices[0].message.audio.data), ref)


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"audio": {"voice": "Nobody", "format": "wav"}}, "audio.voice", ["'Nobody'", "Chelsie", "Ethan"]),
        ({"audio": {"voice": VOICE, "format": "mp3"}}, "audio.format", ["'mp3'", "wav"]),
        ({"n": 2}, None, ["n=1"]),
    ],
    ids=["unknown-voice", "mp3", "n2"],
)
def test_bad_audio_settings_are_400s(client: openai.OpenAI, extra: dict, param: str | None, words: list[str]) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**_request(**{**SPEAK, **extra}))
    err = info.value.body
    assert all(w in err["message"] for w in words), err
    if param is not None:
        assert err["param"] == param
    good = client.chat.completions.create(**_request(**SPEAK))
    assert good.choices[0].message.audio is not None


def test_audio_output_on_a_text_only_checkpoint_is_a_400(server) -> None:
    """The shared tiny-llama server: no talker, so no audio."""
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        body = {"model": server.model, "messages": MESSAGES, "max_tokens": 4}
        resp = http.post("/v1/chat/completions", json={**body, **SPEAK})
        assert resp.status_code == 400
        err = resp.json()["error"]
        assert err["param"] == "modalities" and "cannot produce ['audio']" in err["message"]
        assert http.post("/v1/chat/completions", json=body).status_code == 200


def test_models_health_and_metrics(omni_server, client: openai.OpenAI) -> None:
    thread, _ = omni_server
    assert [m.id for m in client.models.list().data] == [NAME]
    with httpx.Client(base_url=thread.base_url, timeout=30) as http:
        assert http.get("/health").json() == {"status": "ok"}
        metrics = http.get("/metrics")
        assert metrics.status_code == 200 and "kv" in metrics.text.lower()
        # /tokenize and /detokenize use the thinker's tokenizer (the omni engine has no vocab_size of its own).
        tok = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi there"}]}).json()
        assert tok["count"] == len(tok["tokens"]) > 0
        assert http.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"].count("hi there") == 1
        assert http.post("/detokenize", json={"tokens": [10**7]}).status_code == 400


def test_failed_talker_step_fails_the_request_and_the_pipeline_recovers(
    client: openai.OpenAI, reference: RequestOutput, served: RequestOutput, omni_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stage past the thinker fails mid-step: the request gets a 500, every
    stage lets go of it, and the next request is answered as before."""
    runner = omni_server[1].state.engine_client.engine.stages["talker"].runner
    real, fired = runner.execute_model, []

    def execute_model(sched_out: Any) -> Any:
        if not fired:
            fired.append(True)
            raise RuntimeError("injected talker failure")
        return real(sched_out)

    monkeypatch.setattr(runner, "execute_model", execute_model)
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(**_request(**SPEAK))
    assert info.value.body["code"] == "engine_step_failed" and "injected talker failure" in info.value.body["message"]
    _assert_pipeline_empty(omni_server[1])
    completion = client.chat.completions.create(**_request(**SPEAK))
    assert completion.choices[0].message.content == reference.outputs[0].text
    _assert_same_audio(base64.b64decode(completion.choices[0].message.audio.data), served)
