"""The tiny checkpoint writers produce real, loadable, seeded checkpoints whose
tokenizer, processor files and config agree."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from omnistage.testing.tiny_mm_checkpoints import (
    OMNI_SPECIAL_TOKENS,
    VL_SPECIAL_TOKENS,
    write_tiny_qwen2_5_omni_thinker,
    write_tiny_qwen2_5_vl,
)


@pytest.fixture(scope="module")
def vl_path(tmp_path_factory) -> str:
    return write_tiny_qwen2_5_vl(tmp_path_factory.mktemp("vl"))


@pytest.fixture(scope="module")
def thinker_path(tmp_path_factory) -> str:
    return write_tiny_qwen2_5_omni_thinker(tmp_path_factory.mktemp("thinker"))


def test_vl_checkpoint_files_agree(vl_path):
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

    files = set(os.listdir(vl_path))
    expected = {
        "config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
        "chat_template.jinja", "processor_config.json",
    }  # fmt: skip
    assert expected <= files
    # the layout transformers 5 writes: one nested file, no legacy ones
    assert not files & {"preprocessor_config.json", "video_preprocessor_config.json"}
    config = AutoConfig.from_pretrained(vl_path)
    tok = AutoTokenizer.from_pretrained(vl_path)
    assert config.model_type == "qwen2_5_vl" and config.architectures == ["Qwen2_5_VLForConditionalGeneration"]
    assert tok.convert_tokens_to_ids("<|image_pad|>") == config.image_token_id
    assert tok.convert_tokens_to_ids("<|video_pad|>") == config.video_token_id
    assert tok.convert_tokens_to_ids("<|vision_start|>") == config.vision_start_token_id
    assert tok.convert_tokens_to_ids("<|vision_end|>") == config.vision_end_token_id
    assert tok.eos_token_id == config.text_config.eos_token_id
    assert len(tok) <= config.text_config.vocab_size
    for special in VL_SPECIAL_TOKENS:  # one token each, never split
        assert len(tok(special)["input_ids"]) == 1
    assert tok.decode(tok("héllo wörld ✓")["input_ids"]) == "héllo wörld ✓"
    text = tok.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "hi"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        "<|vision_start|><|image_pad|><|vision_end|><|vision_start|><|video_pad|><|vision_end|>hi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    image_processor = AutoImageProcessor.from_pretrained(vl_path, backend="pil")
    assert image_processor.merge_size == config.vision_config.spatial_merge_size
    assert image_processor.patch_size == config.vision_config.patch_size


def test_thinker_checkpoint_files_agree(thinker_path):
    from transformers import AutoConfig, AutoFeatureExtractor, AutoTokenizer

    config = AutoConfig.from_pretrained(thinker_path)
    tok = AutoTokenizer.from_pretrained(thinker_path)
    assert config.model_type == "qwen2_5_omni_thinker"
    assert tok.audio_token_id == config.audio_token_id and tok.image_token_id == config.image_token_id
    assert tok.video_token_id == config.video_token_id
    assert tok.convert_tokens_to_ids(tok.audio_bos_token) == config.audio_start_token_id
    assert tok.convert_tokens_to_ids(tok.audio_eos_token) == config.audio_end_token_id
    assert tok.convert_tokens_to_ids(tok.vision_bos_token) == config.vision_start_token_id
    for special in OMNI_SPECIAL_TOKENS:
        assert len(tok(special)["input_ids"]) == 1
    fe = AutoFeatureExtractor.from_pretrained(thinker_path)
    assert fe.feature_size == config.audio_config.num_mel_bins and fe.sampling_rate == 16000
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "audio"}]}], tokenize=False)
    assert "<|audio_bos|><|AUDIO|><|audio_eos|>" in text and text.startswith("<|im_start|>system\nYou are Qwen")


def test_weights_are_seeded(tmp_path, vl_path):
    again = write_tiny_qwen2_5_vl(tmp_path / "again")
    other = write_tiny_qwen2_5_vl(tmp_path / "other", seed=1)
    a, b, c = (load_file(os.path.join(p, "model.safetensors")) for p in (vl_path, again, other))
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)
    assert all(t.dtype == torch.float32 for t in a.values())
    with open(os.path.join(vl_path, "config.json")) as f:
        assert json.load(f)["text_config"]["rope_parameters"]["mrope_section"] == [2, 1, 1]


def test_full_omni_checkpoint_serves_through_processor_and_adapter(tmp_path):
    """The whole-model checkpoint (tiny_omni_checkpoint.py, built on the
    thinker written here) works with the processor and thinker adapter."""
    from transformers import Qwen2_5OmniForConditionalGeneration

    from omnistage.models.qwen2_5_omni_thinker import Qwen2_5OmniThinkerAdapter
    from omnistage.testing.tiny_omni_checkpoint import write_tiny_qwen2_5_omni
    from omnistage.multimodal.processing import MultiModalProcessor

    path = write_tiny_qwen2_5_omni(tmp_path / "omni")
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(path).eval()
    assert model.has_talker and set(model.speaker_map) == {"Chelsie", "Ethan"}
    thinker_vocab = model.config.thinker_config.text_config.vocab_size
    reserved = set(range(256 + len(OMNI_SPECIAL_TOKENS), thinker_vocab))
    for speaker in model.speaker_map.values():
        assert speaker["bos_token"] in reserved  # a thinker id without a token string
    # the thinker part serves through the same processor and adapter
    proc = MultiModalProcessor.from_pretrained(path)
    assert proc.is_omni and proc.modalities == ("image", "video", "audio")
    adapter = Qwen2_5OmniThinkerAdapter(model)
    out = proc.process(proc.apply_chat_template([{"role": "user", "content": "hi"}]))
    ids = torch.tensor(out.prompt_token_ids)
    positions = adapter.get_mrope_positions(out.prompt_token_ids, [])
    logits = adapter.compute_logits(adapter.forward(adapter.embed_input_ids(ids), positions.prompt))
    with torch.no_grad():
        expected = model.thinker(input_ids=ids[None], attention_mask=torch.ones_like(ids[None])).logits[0]
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
