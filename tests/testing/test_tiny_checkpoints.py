"""Tiny checkpoints are real, deterministic and small."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file
from transformers import AutoTokenizer

from omnistage.testing.tiny_checkpoints import TINY_ARCHS, write_tiny_checkpoint


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_folder_is_a_real_checkpoint(tmp_path, arch):
    path = write_tiny_checkpoint(arch, tmp_path / arch)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == arch
    assert config["hidden_size"] == 64 and config["num_attention_heads"] == 4
    assert config["num_key_value_heads"] == 2  # grouped-query attention
    assert 2 <= config["num_hidden_layers"] <= 4
    tok = AutoTokenizer.from_pretrained(path)
    assert config["vocab_size"] == len(tok)
    text = "hello world, the quick brown fox!"
    assert tok.decode(tok(text)["input_ids"]) == text
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token is not None


def test_untied_and_tied_heads(tmp_path):
    llama = load_file(write_tiny_checkpoint("llama", tmp_path / "l") / "model.safetensors")
    qwen2 = load_file(write_tiny_checkpoint("qwen2", tmp_path / "q") / "model.safetensors")
    assert "lm_head.weight" in llama
    assert "lm_head.weight" not in qwen2  # tied to the embedding


def test_same_seed_same_weights(tmp_path):
    a = load_file(write_tiny_checkpoint("qwen3", tmp_path / "a", seed=3) / "model.safetensors")
    b = load_file(write_tiny_checkpoint("qwen3", tmp_path / "b", seed=3) / "model.safetensors")
    c = load_file(write_tiny_checkpoint("qwen3", tmp_path / "c", seed=4) / "model.safetensors")
    assert a.keys() == b.keys()
    assert all((a[k] == b[k]).all() for k in a)
    assert any((a[k] != c[k]).any() for k in a)
    assert (tmp_path / "a" / "tokenizer.json").read_text() == (tmp_path / "c" / "tokenizer.json").read_text()


def test_unknown_arch(tmp_path):
    with pytest.raises(ValueError, match="unknown tiny architecture 'gpt2'"):
        write_tiny_checkpoint("gpt2", tmp_path)
