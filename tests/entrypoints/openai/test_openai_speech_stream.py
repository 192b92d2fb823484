"""Speech that streams out of the OpenAI server while the talker speaks
(OpenAI's dialect, through the official ``openai`` client): ``delta.audio``
pieces with one id, pcm16 or one WAV header then PCM, the concatenation equal
to the non-streamed answer sample for sample; unsupported formats are 400s; a
client that leaves mid-audio frees every stage."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from omnistage.engine.arg_utils import EngineArgs
from omnistage.entrypoints.openai.api_server import (
    ServerOptions,
    ServerThread,
    build_app,
)
from omnistage.multimodal.media import streaming_wav_header
from omnistage.testing.tiny_omni_checkpoint import write_tiny_qwen2_5_omni

pytest.importorskip("transformers")

NAME = "tiny-omni-streaming-speech"
ENGINE = {"block_size": 4, "max_model_len": 256, "num_kv_blocks": 256, "max_num_seqs": 8}
TALKER = {"temperature": 0.0, "max_tokens": 12}  # a dozen codec frames: two chunks of the tiny DiT schedule
MESSAGES = [{"role": "user", "content": "Say something nice."}]
VOICE, TALKER_STEP_DELAY = "Ethan", 0.1


@pytest.fixture(scope="module")
def speech_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerThread, Any]]:
    path: Path = write_tiny_qwen2_5_omni(tmp_path_factory.mktemp("tiny_omni_streaming"))
    # The tiny talker says codec end after 6 codes here: suppress its stops, so it speaks all 12.
    talker = json.loads((path / "config.json").read_text())["talker_config"]
    stops = [talker[f"tts_codec_{k}_token_id"] for k in ("pad", "start", "end")]
    options = ServerOptions(served_model_names=[NAME], talker_params={**TALKER, "suppress_token_ids": stops})
    app = build_app(EngineArgs(model=str(path), **ENGINE), options)
    thread = ServerThread(app).start()
    try:
        yield thread, app
    finally:
        thread.stop()


@pytest.fixture
def slow_talker(speech_server: tuple[ServerThread, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A talker step as slow as a real one relative to the tiny vocoder, so the
    first chunk's head start over the last is visible from the client."""
    talker = speech_server[1].state.engine_client.engine.stages["talker"]
    real_step = talker.step

    def step() -> Any:
        time.sleep(TALKER_STEP_DELAY)
        return real_step()

    monkeypatch.setattr(talker, "step", step)  # called on the engine thread only


@pytest.fixture
def client(speech_server: tuple[ServerThread, Any]) -> Iterator[openai.OpenAI]:
    thread, app = speech_server
    with openai.OpenAI(base_url=thread.base_url + "/v1", api_key="unused", max_retries=0) as c:
        yield c
    _assert_pipeline_empty(app)


def _assert_pipeline_empty(app: Any, timeout: float = 15.0) -> None:
    client = app.state.engine_client
    deadline = time.monotonic() + timeout
    while True:
        held = client.call_sync(lambda e: e.held())
        if all(h.is_empty for h in held.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert all(h.is_empty for h in held.values()), {k: v for k, v in held.items() if not v.is_empty}


def _request(audio_format: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": NAME,
        "messages": MESSAGES,
        "max_completion_tokens": 8,
        "temperature": 0.0,
        "seed": 11,
        "modalities": ["text", "audio"],
        "audio": {"voice": VOICE, "format": audio_format},
        **extra,
    }


def _stream_audio(client: openai.OpenAI, audio_format: str) -> tuple[str, list[tuple[float, Any]]]:
    """(the streamed text, [(arrival time, delta.audio)])."""
    text, pieces = "", []
    for chunk in client.chat.completions.create(**_request(audio_format), stream=True):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.delta.audio is not None:
                pieces.append((time.monotonic(), choice.delta.audio))
    return text, pieces


def test_pcm16_stream_is_the_unstreamed_answer_and_starts_early(client: openai.OpenAI, slow_talker: None) -> None:
    text, pieces = _stream_audio(client, "pcm16")
    answer = client.chat.completions.create(**_request("pcm16")).choices[0].message
    want = base64.b64decode(answer.audio.data)
    assert text == answer.content and len(want) == 2 * 480 * 12  # 16-bit samples of a dozen codes
    audio = [a for _, a in pieces]
    assert len(audio) >= 2 and len({a.id for a in audio}) == 1 and audio[0].id.startswith("audio")
    assert audio[0].transcript == text and all(a.transcript == "" for a in audio[1:])
    data = [base64.b64decode(a.data) for a in audio]
    assert all(len(d) % 6 == 0 for d in data[:-1])  # whole samples, base64 without padding
    assert b"".join(data) == want  # sample for sample
    assert base64.b64decode("".join(a.data for a in audio)) == want  # clients that join the base64 strings
    # The first chunk leaves once the talker has 8 codes: 4 talker steps before its last.
    assert pieces[-1][0] - pieces[0][0] > 3 * TALKER_STEP_DELAY


def test_wav_stream_sends_one_header_then_pcm(client: openai.OpenAI) -> None:
    _, pieces = _stream_audio(client, "wav")
    stream = b"".join(base64.b64decode(a.data) for _, a in pieces)
    whole = base64.b64decode(client.chat.completions.create(**_request("wav")).choices[0].message.audio.data)
    assert len(pieces) >= 2 and stream.startswith(streaming_wav_header(24000)) and stream.count(b"RIFF") == 1
    assert whole[:4] == b"RIFF" and whole[36:40] == b"data"  # the non-streamed file knows its length
    assert stream[44:] == whole[44:] and len(stream[44:]) == 2 * 480 * 12
    samples = np.frombuffer(stream[44:], dtype="<i2")
    assert samples.std() > 100  # it is audio, not silence


@pytest.mark.parametrize("audio_format", ["mp3", "flac", "opus", "aac"])
@pytest.mark.parametrize("stream", [False, True])
def test_unsupported_formats_are_400s(client: openai.OpenAI, audio_format: str, stream: bool) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**_request(audio_format), stream=stream)
    err = info.value.body
    assert err["param"] == "audio.format" and repr(audio_format) in err["message"] and "pcm16" in err["message"]


def test_leaving_mid_audio_aborts_it_in_every_stage(
    speech_server: tuple[ServerThread, Any], slow_talker: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client leaves after the first audio piece: the request is then in the
    talker and the vocoder at once; both let go of it."""
    thread, app = speech_server
    vocoder = app.state.engine_client.engine.stages["token2wav"]
    vocoded: list[str] = []
    real_add = vocoder.add_request

    def add_request(request_id: str, *args: Any, **kwargs: Any) -> None:
        vocoded.append(request_id)
        real_add(request_id, *args, **kwargs)

    monkeypatch.setattr(vocoder, "add_request", add_request)
    audio_seen = False
    body = {**_request("pcm16"), "stream": True}
    with (
        httpx.Client(base_url=thread.base_url, timeout=30) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {") and any(c["delta"].get("audio") for c in json.loads(line[6:])["choices"]):
                audio_seen = True
                break  # leave with the talker still speaking
    assert audio_seen and len(vocoded) == 1
    _assert_pipeline_empty(app)
    held = app.state.engine_client.call_sync(lambda e: e.held())
    assert held["token2wav"].is_empty and held["talker"].is_empty
