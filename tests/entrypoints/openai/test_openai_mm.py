"""The OpenAI server passes decoded images and audio through to a multimodal
model: the answer equals the offline LLM's for the same content."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest

from omnistage.engine.arg_utils import EngineArgs
from omnistage.entrypoints.llm import LLM
from omnistage.entrypoints.openai.api_server import ServerOptions, ServerThread, build_app
from omnistage.testing.tiny_mm_checkpoints import write_tiny_qwen2_5_omni_thinker
from omnistage.sampling_params import SamplingParams

from oai_helpers import png_bytes, wav_bytes

NAME = "tiny-omni"


@pytest.fixture(scope="module")
def omni_server(tmp_path_factory):
    path = write_tiny_qwen2_5_omni_thinker(tmp_path_factory.mktemp("omni"))
    args = EngineArgs(model=str(path), max_model_len=1024, block_size=4)
    app = build_app(args, ServerOptions(served_model_names=[NAME]))
    thread = ServerThread(app).start()
    try:
        yield thread, path
    finally:
        thread.stop()


def test_image_and_audio_parts_reach_the_model(omni_server):
    thread, path = omni_server
    png = png_bytes(90, 60, (10, 200, 30))
    rng = np.random.default_rng(0)
    wav = wav_bytes(rng.standard_normal(8000) * 0.1)
    content = [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}},
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}},
        {"type": "text", "text": "what do you see and hear?"},
    ]
    body = {"model": NAME, "messages": [{"role": "user", "content": content}], "max_tokens": 5, "temperature": 0}
    with httpx.Client(base_url=thread.base_url, timeout=60) as client:
        resp = client.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
        answer = resp.json()
        # an image the model's processor cannot read is the client's error, naming the part
        bad = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
        resp = client.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": bad}]})
        assert resp.status_code == 400 and "messages[0].content[0]" in resp.json()["error"]["message"]
    llm = LLM(str(path), max_model_len=1024, block_size=4)
    (ref,) = llm.chat(
        [{"role": "user", "content": content}], SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False
    )
    assert answer["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)
    assert answer["usage"]["prompt_tokens"] > 200  # the placeholders were expanded
    assert answer["choices"][0]["message"]["content"] == ref.outputs[0].text
