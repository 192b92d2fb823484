"""LLM.generate with vLLM-style multimodal dicts and LLM.chat with
OpenAI-style content parts, on tiny Qwen2.5-VL / Qwen2.5-Omni checkpoints."""

from __future__ import annotations

import base64
import io
import struct
import wave

import numpy as np
import pytest
from PIL import Image

from omnistage.entrypoints.llm import LLM
from omnistage.testing.tiny_mm_checkpoints import write_tiny_qwen2_5_omni_thinker, write_tiny_qwen2_5_vl
from omnistage.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py


@pytest.fixture(scope="module")
def vl(tmp_path_factory) -> LLM:
    return LLM(str(write_tiny_qwen2_5_vl(tmp_path_factory.mktemp("vl"))), block_size=4, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def omni(tmp_path_factory) -> LLM:
    return LLM(str(write_tiny_qwen2_5_omni_thinker(tmp_path_factory.mktemp("omni"))), block_size=4)


def _image(seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (60, 90, 3), dtype=np.uint8))


def _png_data_url(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _wav_b64(samples: np.ndarray, rate: int) -> str:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes((samples * 32768).astype("<i2").tobytes())
    return base64.b64encode(buf.getvalue()).decode()


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_chat_parts_equal_the_generate_dict(vl, tmp_path):
    img = _image(0)
    path = tmp_path / "cat.png"
    img.save(path)
    tokenizer = vl.get_tokenizer()
    template = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]}]
    prompt = tokenizer.apply_chat_template(template, tokenize=False, add_generation_prompt=True)
    (by_dict,) = vl.generate({"prompt": prompt, "multi_modal_data": {"image": img}}, GREEDY, use_tqdm=False)
    encoded = vl.llm_engine.runner.num_encoded_items
    outs = vl.chat(
        [
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _png_data_url(img)}},
                                          {"type": "text", "text": "what is it?"}]}],
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": str(path)}},
                                          {"type": "text", "text": "what is it?"}]}],
            [{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": "what is it?"}]}],
        ],
        GREEDY,
        use_tqdm=False,
    )  # fmt: skip
    for out in outs:
        assert out.prompt_token_ids == by_dict.prompt_token_ids
        assert out.outputs[0].token_ids == by_dict.outputs[0].token_ids
    # the same pixels by data URL, path or PIL image share one content hash: no new encoder run
    assert vl.llm_engine.runner.num_encoded_items == encoded


def test_chat_input_audio_and_mixed_batch(omni):
    rng = np.random.default_rng(0)
    samples = np.round(rng.standard_normal(16000) * 0.1 * 32768).clip(-32768, 32767) / 32768
    tokenizer = omni.get_tokenizer()
    parts = [{"type": "audio"}, {"type": "text", "text": "listen"}]
    messages = [{"role": "user", "content": parts}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    by_dict = omni.generate(
        [{"prompt": prompt, "multi_modal_data": {"audio": (samples.astype(np.float32), 16000)}}, "text only"],
        GREEDY,
        use_tqdm=False,
    )
    wav = {"type": "input_audio", "input_audio": {"data": _wav_b64(samples, 16000), "format": "wav"}}
    chat = [{"role": "user", "content": [wav, {"type": "text", "text": "listen"}]}]
    (by_chat,) = omni.chat(chat, GREEDY, use_tqdm=False)
    assert by_chat.prompt_token_ids == by_dict[0].prompt_token_ids
    assert by_chat.outputs[0].token_ids == by_dict[0].outputs[0].token_ids
    assert len(by_dict) == 2 and by_dict[1].outputs[0].token_ids


def _wav_24bit(ints: np.ndarray, rate: int) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(3)
        f.setframerate(rate)
        f.writeframes(b"".join(int(v).to_bytes(3, "little", signed=True) for v in ints))
    return buf.getvalue()


def test_chat_takes_24_bit_and_float_wavs(omni, tmp_path):
    """24-bit and float WAVs (the server always took them) in ``input_audio``
    parts and as paths decode to exactly the samples written: the answer equals
    the one for the float array, and no new encoder run happens (same content hash)."""
    ints = np.random.default_rng(3).integers(-(1 << 22), 1 << 22, 16000)
    samples = (ints / float(1 << 23)).astype(np.float32)
    tokenizer = omni.get_tokenizer()
    parts = [{"type": "audio"}, {"type": "text", "text": "listen"}]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": parts}], tokenize=False, add_generation_prompt=True)
    (by_dict,) = omni.generate({"prompt": prompt, "multi_modal_data": {"audio": (samples, 16000)}}, GREEDY, use_tqdm=False)
    encoded = omni.llm_engine.runner.num_encoded_items
    float_path = tmp_path / "float.wav"
    f32 = samples.astype("<f4").tobytes()
    fmt = struct.pack("<HHIIHH", 3, 1, 16000, 16000 * 4, 4, 32)
    float_path.write_bytes(
        b"RIFF" + struct.pack("<I", 4 + 24 + 8 + len(f32)) + b"WAVEfmt " + struct.pack("<I", 16) + fmt
        + b"data" + struct.pack("<I", len(f32)) + f32
    )  # fmt: skip
    b64 = base64.b64encode(_wav_24bit(ints, 16000)).decode()
    chats = [
        [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": b64, "format": "wav"}},
                                      {"type": "text", "text": "listen"}]}],
        [{"role": "user", "content": [{"type": "audio", "audio": str(float_path)}, {"type": "text", "text": "listen"}]}],
    ]  # fmt: skip
    for out in omni.chat(chats, GREEDY, use_tqdm=False):
        assert out.prompt_token_ids == by_dict.prompt_token_ids
        assert out.outputs[0].token_ids == by_dict.outputs[0].token_ids
    assert omni.llm_engine.runner.num_encoded_items == encoded


def test_bad_item_raises_before_anything_is_queued(vl):
    engine = vl.llm_engine
    tokenizer = vl.get_tokenizer()
    template = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hm"}]}]
    prompt = tokenizer.apply_chat_template(template, tokenize=False, add_generation_prompt=True)
    good = {"prompt": prompt, "multi_modal_data": {"image": _image(1)}}
    bad = {"prompt": prompt, "multi_modal_data": {"image": "data:image/png;base64,bm90IGFuIGltYWdl"}}
    steps = engine.num_steps
    with pytest.raises(ValueError, match=r"request '\d+': image item 0: could not decode"):
        vl.generate([good, bad], GREEDY, use_tqdm=False)
    assert not engine.has_unfinished_requests() and engine.num_steps == steps
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]: video URLs cannot be decoded"):
        vl.chat([{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "x.mp4"}}]}], GREEDY)
    (out,) = vl.generate(good, GREEDY, use_tqdm=False)  # the engine is as good as before
    assert len(out.outputs[0].token_ids) == GREEDY.max_tokens


def test_whole_omni_checkpoint_runs_its_thinker(omni, tmp_path):
    """``LLM`` on a Qwen2_5OmniForConditionalGeneration folder is the omni pipeline;
    its thinker gives the same answers as the thinker-only checkpoint written
    with the same seed."""
    from omnistage.engine.omni.pipeline import OmniPipeline
    from omnistage.testing.tiny_omni_checkpoint import write_tiny_qwen2_5_omni

    whole = LLM(str(write_tiny_qwen2_5_omni(tmp_path / "whole")), block_size=4)
    assert isinstance(whole.llm_engine, OmniPipeline)
    thinker = whole.llm_engine.stages["thinker"]
    assert thinker.loaded_model.hf_config.model_type == "qwen2_5_omni"
    assert thinker.input_modalities == {"text", "image", "video", "audio"}
    msgs = [{"role": "user", "content": [{"type": "image", "image": _image(2)}, {"type": "text", "text": "hi"}]}]
    assert _ids(whole.chat(msgs, GREEDY, return_audio=False)) == _ids(omni.chat(msgs, GREEDY, use_tqdm=False))


def test_audio_to_a_vision_model_is_refused_for_its_modality_first(vl):
    """Issue 12 on a model that takes media, but not audio: an audio part is
    refused for what it is before it is read (never "not a WAV" or "send WAV"),
    naming the part, while an undecodable image still reaches the decoder."""
    garbage = base64.b64encode(b"OggS....").decode()
    for fmt in ("wav", "mp3"):
        part = {"type": "input_audio", "input_audio": {"data": garbage, "format": fmt}}
        msgs = [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}]
        with pytest.raises(ValueError, match=r"^messages\[0\]\.content\[1\]: this model does not take audio input"):
            vl.chat(msgs, GREEDY, use_tqdm=False)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,!!!!"}}
    with pytest.raises(ValueError, match="image item 0: invalid base64"):
        vl.chat([{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}], GREEDY, use_tqdm=False)
