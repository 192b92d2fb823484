"""Speech out of the OpenAI server on a Qwen3-Omni folder, through the existing
server path: ``modalities: ["text", "audio"]`` returns the offline ``LLM``'s
words and waveform for the same prompt and settings: the server decodes in chunks,
which equals the offline whole decode to 1e-6 per sample, then rounds to int16."""

from __future__ import annotations

import base64
import io
import time
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest

from omnistage import LLM
from omnistage.engine.arg_utils import EngineArgs
from omnistage.entrypoints.openai.api_server import (
    ServerOptions,
    ServerThread,
    build_app,
)
from omnistage.sampling_params import SamplingParams
from omnistage.testing.tiny_qwen3_omni_checkpoint import write_tiny_qwen3_omni

pytest.importorskip("transformers")

NAME = "tiny-qwen3-omni"
ENGINE = {
    "block_size": 4,
    "max_model_len": 256,
    "num_kv_blocks": 256,
    "max_num_seqs": 8,
}
TALKER = {"temperature": 0.0, "repetition_penalty": 1.0, "max_tokens": 14}  # a dozen frames: several chunks
MESSAGES = [{"role": "user", "content": "Say something nice."}]
MAX_TOKENS, VOICE = 8, "Chelsie"


@pytest.fixture(scope="module")
def q3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen3_omni(tmp_path_factory.mktemp("tiny_qwen3_server"))


@pytest.fixture(scope="module")
def server(q3_dir: Path) -> Iterator[tuple[ServerThread, Any]]:
    app = build_app(
        EngineArgs(model=str(q3_dir), **ENGINE),
        ServerOptions(served_model_names=[NAME], talker_params=TALKER),
    )
    thread = ServerThread(app).start()
    try:
        yield thread, app
    finally:
        thread.stop()


def test_audio_answer_is_the_offline_pipelines(
    server: tuple[ServerThread, Any], q3_dir: Path
) -> None:
    offline = LLM(str(q3_dir), talker_params=TALKER, **ENGINE)
    (ref,) = offline.chat(
        MESSAGES, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), speaker=VOICE
    )
    assert ref.audio is not None and ref.audio.size > 0
    thread, app = server
    with openai.OpenAI(
        base_url=thread.base_url + "/v1", api_key="unused", max_retries=0
    ) as client:
        models = [m.id for m in client.models.list().data]
        assert NAME in models
        completion = client.chat.completions.create(
            model=NAME, messages=MESSAGES, max_completion_tokens=MAX_TOKENS, temperature=0.0,
            modalities=["text", "audio"], audio={"voice": VOICE, "format": "wav"},
        )  # fmt: skip
    message = completion.choices[0].message
    assert message.content == ref.outputs[0].text
    with wave.open(io.BytesIO(base64.b64decode(message.audio.data))) as f:
        assert (f.getframerate(), f.getnchannels(), f.getsampwidth()) == (24000, 1, 2)
        got = np.frombuffer(f.readframes(f.getnframes()), dtype="<i2")
    want = np.clip(ref.audio.astype(np.float64), -1.0, 1.0) * 32767.0
    assert got.shape == want.shape and np.abs(got - want).max() <= 0.5 + 32767 * 1e-6
    deadline = time.monotonic() + 15
    while True:  # every stage drops its last rows one step after a request ends
        held = app.state.engine_client.call_sync(lambda e: e.held())
        if all(h.is_empty for h in held.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert all(h.is_empty for h in held.values()), held


def test_pcm16_stream_is_the_unstreamed_answer(server: tuple[ServerThread, Any]) -> None:
    """With ``stream: true`` the audio leaves in several pieces with one id, and their
    PCM is the non-streamed answer's PCM (the server decodes both in chunks)."""
    thread, _ = server
    body = {
        "model": NAME, "messages": MESSAGES, "max_completion_tokens": MAX_TOKENS, "temperature": 0.0,
        "modalities": ["text", "audio"], "audio": {"voice": VOICE, "format": "pcm16"},
    }  # fmt: skip
    with openai.OpenAI(base_url=thread.base_url + "/v1", api_key="unused", max_retries=0) as client:
        pieces = [
            choice.delta.audio
            for chunk in client.chat.completions.create(**body, stream=True)
            for choice in chunk.choices
            if choice.delta.audio is not None
        ]
        whole = base64.b64decode(client.chat.completions.create(**body).choices[0].message.audio.data)
    audio = [p for p in pieces if p.data]
    assert len(audio) >= 2 and len({p.id for p in pieces}) == 1
    assert b"".join(base64.b64decode(p.data) for p in audio) == whole


def test_voice_names_match_case_insensitively(server: tuple[ServerThread, Any]) -> None:
    """Found in review: the server refused ``"ethan"`` (a 400, unknown voice) where the
    offline ``LLM`` resolves speakers case-insensitively; it is the voice ``"Ethan"``."""
    thread, _ = server
    body = {
        "model": NAME, "messages": MESSAGES, "max_completion_tokens": MAX_TOKENS, "temperature": 0.0,
        "modalities": ["text", "audio"],
    }  # fmt: skip
    with openai.OpenAI(base_url=thread.base_url + "/v1", api_key="unused", max_retries=0) as client:
        audio = {
            voice: client.chat.completions.create(**body, audio={"voice": voice, "format": "pcm16"})
            .choices[0].message.audio.data
            for voice in ("Ethan", "ethan", "ETHAN", "Chelsie")
        }
        with pytest.raises(openai.BadRequestError, match="Unknown voice 'Nobody'"):
            client.chat.completions.create(**body, audio={"voice": "Nobody", "format": "pcm16"})
    assert audio["ethan"] == audio["Ethan"] == audio["ETHAN"] != audio["Chelsie"]
