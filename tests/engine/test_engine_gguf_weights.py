"""Checkpoints with GGUF-quantized weights decode on the native group-int8 matmul, and their greedy
outputs still equal transformers' generate on the same fp32 weights."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM
from utils_engine import GREEDY, PROMPTS, assert_pool_clean, hf_greedy, make_engine, run_all

import omnistage.models.fast_forward as ff
from omnistage.kernels.native import native_kernels
from omnistage.models.loader import load_model
from omnistage.testing.tiny_checkpoints import TINY_ARCHS, write_tiny_checkpoint

pytestmark = pytest.mark.skipif(native_kernels() is None, reason="native kernels need x86-64 AVX2 and g++")


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_gguf_weights_run_on_int8_kernels_and_match_hf(arch, tmp_path, monkeypatch):
    path = write_tiny_checkpoint(arch, tmp_path, gguf_weights=True)
    loaded = load_model(str(path))
    lean = loaded.model.lean
    linears = [lean.lm_head] + [lin for layer in lean.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    assert all(lin.int8 is not None for lin in linears)

    rows_seen: set[int] = set()
    matmul = ff.group_int8_matmul

    def counting(x, weight):
        rows_seen.add(x.shape[0])
        return matmul(x, weight)

    monkeypatch.setattr(ff, "group_int8_matmul", counting)
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = [loaded.tokenizer.encode(p) for p in PROMPTS]
    refs = [hf_greedy(hf, i, GREEDY.max_tokens) for i in ids]
    engine = make_engine(loaded)
    (solo,) = run_all(engine, [PROMPTS[0]], GREEDY, prefix="solo-")
    assert solo.outputs[0].token_ids == refs[0]
    # Twelve rows: the kernel's 8-row blocks plus a 4-row tail.
    outs = run_all(engine, PROMPTS * 3, GREEDY, prefix="many-")
    assert [o.outputs[0].token_ids for o in outs] == refs * 3
    assert {1, 12} <= rows_seen
    assert_pool_clean(engine)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_int8_weights_are_the_only_copy_and_the_hf_path_gets_them_back(arch, tmp_path):
    """The lean decoder keeps GGUF-exact weights only in int8; anything that runs the HF modules
    first gets their fp32 weights back, bit for bit, and computes what transformers computes."""
    import torch

    path = write_tiny_checkpoint(arch, tmp_path, gguf_weights=True)
    loaded = load_model(str(path))
    lm = loaded.model
    lean = lm.lean
    assert not lean.holds_hf_weights
    assert all(lin.weight is None for layer in lean.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
    q_proj = lm._hf.model.layers[0].self_attn.q_proj.weight
    assert q_proj.untyped_storage().nbytes() <= 4  # a one-element placeholder of the right shape
    ref = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.tensor([3, 9, 27, 5])
    assert torch.equal(lm.embed_input_ids(ids), ref.get_input_embeddings()(ids))  # from the int8 rows

    lm.use_lean = False  # the HF modules run now: their weights must be back
    assert lean.holds_hf_weights
    for (name, got), want in zip(lm.hf_model.state_dict().items(), ref.state_dict().values(), strict=True):
        assert torch.equal(got, want), name
    engine = make_engine(loaded)  # on the HF modules
    (out,) = run_all(engine, PROMPTS[:1], GREEDY, prefix="hf-")
    assert out.outputs[0].token_ids == hf_greedy(ref, loaded.tokenizer.encode(PROMPTS[0]), GREEDY.max_tokens)
    assert_pool_clean(engine)
