"""The lean decoder forward against the HF modeling path, on tiny real checkpoints."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

import omnistage.models.fast_forward as ff
from omnistage.models.adapter import LEAN_ENV, CausalLM
from omnistage.models.loader import load_model
from omnistage.testing.tiny_checkpoints import TINY_ARCHS, write_tiny_checkpoint
from omnistage.sampling_params import SamplingParams
from omnistage.attention.paged_attention import allocate_kv_caches, build_attention_metadata
from omnistage.worker.input_batch import InputBatch

BLOCK = 4


@pytest.fixture(scope="module", params=TINY_ARCHS)
def tiny(request, tmp_path_factory):
    return request.param, write_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def run_steps(lm: CausalLM, seqs: list[list[int]], schedule: list[dict[int, int]]) -> list[torch.Tensor]:
    """Logits of every scheduled token, step by step, over a shuffled block pool."""
    caches = allocate_kv_caches(lm.num_layers, 64, BLOCK, lm.num_kv_heads, lm.head_dim, lm.dtype, lm.device)
    batch = InputBatch(max_num_reqs=8, max_model_len=128, block_size=BLOCK, device=lm.device)
    free = list(range(64))
    random.Random(0).shuffle(free)
    for i, s in enumerate(seqs):
        batch.add_request(f"r{i}", s, len(s), 0, [free.pop() for _ in range(-(-len(s) // BLOCK))], SamplingParams())
    out = []
    for sched in schedule:
        step = batch.prepare_step({f"r{i}": n for i, n in sched.items()})
        md = build_attention_metadata(step, BLOCK)
        out.append(lm.compute_logits(lm.forward(step.input_ids, step.positions, md, caches)))
        for i, req_id in enumerate(step.req_ids):
            batch.update_request(req_id, [], int(step.seq_lens[i]))
    return out


SEQS = [[5, 9, 14, 3, 22, 7, 8, 30, 11], [40, 41, 2, 6, 17], [12, 13, 14, 15, 16, 17, 18]]
# Packed prefill of all three, a chunked/mixed step, then decode steps.
SCHEDULE = [{0: 6, 1: 5, 2: 3}, {0: 1, 2: 4}, {0: 1}, {0: 1}]


def test_lean_path_is_taken_for_supported_archs(tiny):
    _, path = tiny
    lm = load_model(str(path)).model
    assert lm.lean is not None and lm.use_lean


def test_lean_equals_hf_path(tiny):
    _, path = tiny
    lm = load_model(str(path)).model
    lm.use_lean = True
    lean = run_steps(lm, SEQS, SCHEDULE)
    lm.use_lean = False
    hf = run_steps(lm, SEQS, SCHEDULE)
    for a, b in zip(lean, hf):
        # 2e-5: the mixed step's few queries per sequence attend by matmul + softmax (like
        # decode), whose rounding differs from the flash kernel's by ~1e-5 between the paths.
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)


def test_lean_bf16_matches_hf_path_and_greedy_tokens_match_logits(tiny):
    """bf16 runs on oneDNN-prepacked weights in every matmul; it must agree with
    HF's modules in bf16 (to bf16 rounding), and greedy_token_ids with the logits' argmax."""
    _, path = tiny
    lm = load_model(str(path), dtype="bfloat16").model
    assert lm.lean is not None and lm.lean.layers[0].qkv.weight.is_contiguous()  # not transposed in bf16
    lean = run_steps(lm, SEQS, SCHEDULE)
    lm.use_lean = False
    hf = run_steps(lm, SEQS, SCHEDULE)
    for a, b in zip(lean, hf):
        torch.testing.assert_close(a, b, atol=0.1, rtol=0.05)
    lm.use_lean = True
    hidden = torch.randn(5, lm.hidden_size, dtype=torch.bfloat16)
    assert torch.equal(lm.greedy_token_ids(hidden), lm.compute_logits(hidden).argmax(-1))


def test_lean_equals_hf_reference_logits(tiny):
    _, path = tiny
    lm = load_model(str(path)).model
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    got = run_steps(lm, SEQS[:1], [{0: 4}, {0: 1}, {0: 4}])
    with torch.no_grad():
        want = ref(torch.tensor([SEQS[0]])).logits[0]
    torch.testing.assert_close(torch.cat(got), want, atol=1e-4, rtol=1e-4)


def test_fused_weights_share_memory_with_hf_parameters(tiny):
    _, path = tiny
    lm = load_model(str(path)).model
    layer = lm.hf_model.model.layers[0]
    fused = lm.lean.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    assert attn.q_proj.weight.data_ptr() == fused.qkv.weight.data_ptr()
    assert attn.k_proj.weight.data_ptr() == fused.qkv.weight[attn.q_proj.out_features :].data_ptr()
    assert mlp.gate_proj.weight.data_ptr() == fused.gate_up.weight.data_ptr()
    torch.testing.assert_close(fused.gate_up.weight[mlp.gate_proj.out_features :], mlp.up_proj.weight)


def test_env_switches_the_lean_path_off(tiny, monkeypatch):
    _, path = tiny
    monkeypatch.setenv(LEAN_ENV, "0")
    lm = load_model(str(path)).model
    assert lm.lean is None and not lm.use_lean


def test_prepack_off_by_env_and_size(tiny, monkeypatch):
    _, path = tiny
    monkeypatch.setenv(ff.PREPACK_ENV, "0")
    assert load_model(str(path)).model.lean.layers[0].qkv.packed is None
    monkeypatch.delenv(ff.PREPACK_ENV)
    monkeypatch.setenv(ff.PREPACK_MAX_BYTES_ENV, "1000")
    assert load_model(str(path)).model.lean.layers[0].qkv.packed is None


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
@pytest.mark.parametrize("rows", [1, 3, 4, 32, 100, 600])
def test_packed_linear_matches_f_linear(rows):
    torch.manual_seed(0)
    w, b = torch.randn(96, 48), torch.randn(96)
    lin = ff.PackedLinear(w, b, prepack=True)
    assert lin.packed is not None
    x = torch.randn(rows, 48)
    got = lin(x)
    if not ff.PREPACK_MIN_ROWS <= rows <= ff.PREPACK_MAX_ROWS:
        assert torch.equal(got, F.linear(x, w, b))
    else:
        torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-4, rtol=1e-5)


def test_other_architectures_keep_the_hf_path(tiny):
    arch, path = tiny
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf.config.hidden_act = "gelu"  # not the SiLU MLP the lean forward implements
    assert ff.lean_decoder_or_none(hf) is None

    class Custom(type(hf)):
        pass

    hf2 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf2.__class__ = Custom  # a subclass may change the forward: not ours to replicate
    assert ff.lean_decoder_or_none(hf2) is None


@pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    reason="needs oneDNN with bf16",
)
@pytest.mark.parametrize("rows", [1, 32, 600])
def test_packed_linear_bf16_uses_onednn_at_every_size(rows):
    torch.manual_seed(0)
    w, b = torch.randn(96, 48).bfloat16(), torch.randn(96).bfloat16()
    lin = ff.PackedLinear(w, b, prepack=True)
    x = torch.randn(rows, 48).bfloat16()
    want = F.linear(x.float(), w.float(), b.float())
    torch.testing.assert_close(lin(x).float(), want, atol=0.1, rtol=0.02)  # bf16 output rounding
    assert lin.min_rows <= rows <= lin.max_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (7, 576), (32, 896), (300, 2048), (5, 12, 64)])
def test_rms_norm_is_bit_identical_to_hf(dtype, shape):
    """The lean norm must equal HF's op-by-op RMSNorm exactly, or greedy paths could part."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    x = (torch.randn(shape) * torch.rand(shape[0], *([1] * (len(shape) - 1))) * 10).to(dtype)
    norm = LlamaRMSNorm(shape[-1], eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1]))
        want = norm(x)
    assert torch.equal(ff._rms_norm(x, norm.weight.detach(), 1e-5), want)
