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

pytestmark = pytest.mark.skipif(native_kernels() is None, reason="native kernels need x86-64 AVX-512 and g++")


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
