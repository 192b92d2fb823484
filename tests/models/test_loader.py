"""load_model on tiny real checkpoints, and its errors for bad inputs."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from omnistage.models.adapter import CausalLM
from omnistage.models.loader import LoadedModel, load_model, resolve_dtype
from omnistage.testing.tiny_checkpoints import write_tiny_checkpoint
from omnistage.attention.paged_attention import ATTN_IMPL


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return write_tiny_checkpoint("llama", tmp_path_factory.mktemp("ckpt") / "tiny-llama")


def test_loads_a_tiny_folder(tiny_llama):
    loaded = load_model(str(tiny_llama))
    assert isinstance(loaded, LoadedModel)
    assert isinstance(loaded.model, CausalLM)
    assert loaded.name == "tiny-llama"
    assert loaded.model_path == str(tiny_llama)
    assert loaded.max_model_len == 512
    tok = loaded.tokenizer
    im_end, eot = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    assert loaded.eos_token_ids == [im_end, eot]  # generation_config order, no duplicates
    m = loaded.model
    assert (m.num_layers, m.num_kv_heads, m.head_dim, m.hidden_size) == (2, 2, 16, 64)
    assert m.vocab_size == len(tok) and m.dtype == torch.float32 and m.device.type == "cpu"
    assert m.hf_model.config._attn_implementation == ATTN_IMPL
    assert loaded.hf_config.model_type == "llama"


def test_adapter_shapes_and_dtypes(tiny_llama):
    m = load_model(tiny_llama, dtype="bfloat16").model
    assert m.dtype == torch.bfloat16
    ids = torch.tensor([5, 6, 7])
    assert m.embed_input_ids(ids).shape == (3, 64)
    logits = m.compute_logits(torch.zeros(2, 64, dtype=torch.bfloat16))
    assert logits.shape == (2, m.vocab_size) and logits.dtype == torch.float32


def test_missing_path_names_it(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match="nope.*does not exist.*config.json"):
        load_model(str(missing))


def test_folder_without_config_or_weights(tmp_path, tiny_llama):
    folder = tmp_path / "broken"
    shutil.copytree(tiny_llama, folder)
    (folder / "config.json").unlink()
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"broken.*lacks config\.json, model weights \(\*\.safetensors\)"):
        load_model(folder)


def test_folder_without_tokenizer(tmp_path, tiny_llama):
    folder = tmp_path / "notok"
    shutil.copytree(tiny_llama, folder)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="lacks a tokenizer"):
        load_model(folder)


def test_file_that_is_not_gguf(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0")
    with pytest.raises(ValueError, match=r"weights\.bin.*not a \.gguf file"):
        load_model(f)


def _with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_unsupported_architecture(tmp_path, tiny_llama):
    folder = _with_config(
        tiny_llama, tmp_path / "gpt2", model_type="gpt2", architectures=["GPT2LMHeadModel"], n_layer=2
    )
    with pytest.raises(ValueError, match=r"gpt2.*GPT2LMHeadModel.*'gpt2'.*not supported.*llama"):
        load_model(folder)


def test_sliding_window_is_refused(tmp_path):
    folder = write_tiny_checkpoint("qwen2", tmp_path / "q2")
    _with_config(folder, tmp_path / "q2-sliding", use_sliding_window=True, sliding_window=8, max_window_layers=0)
    with pytest.raises(ValueError, match="sliding-window"):
        load_model(tmp_path / "q2-sliding")


def test_bad_dtype():
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        resolve_dtype("float8")
    assert resolve_dtype("bf16") is torch.bfloat16 and resolve_dtype(torch.float16) is torch.float16


def test_longrope_is_refused(tmp_path, tiny_llama):
    """longrope picks its factors from the longest position in a rotary call, which a packed batch
    shares: a request's tokens would depend on the requests beside it."""
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 16,
            "short_factor": [1.0] * 4, "long_factor": [4.0] * 4}  # fmt: skip
    folder = _with_config(tiny_llama, tmp_path / "longrope", rope_parameters=rope, rope_scaling=rope)
    with pytest.raises(ValueError, match="longrope' is not supported"):
        load_model(folder)
