"""The native elementwise decode steps against the torch expressions they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from omnistage.kernels.decode_ops import native_kv_store, native_rms_norm, native_rope, native_silu_mul
from omnistage.kernels.native import native_kernels
from omnistage.models.fast_forward import _rms_norm

pytestmark = pytest.mark.skipif(native_kernels() is None, reason="native kernels need x86-64 AVX2 and g++")


@pytest.mark.parametrize("rows,width", [(1, 576), (33, 576), (5, 100), (300, 64)])
def test_rms_norm_matches_hf_op_for_op_norm(rows, width):
    gen = torch.Generator().manual_seed(width)
    x = torch.randn(rows, width, generator=gen) * 3
    weight = 1 + 0.1 * torch.randn(width, generator=gen)
    got = native_rms_norm(x, weight, 1e-5)
    # Only the order of summing the squares differs from HF's ops: an ulp or so.
    torch.testing.assert_close(got, _rms_norm(x, weight, 1e-5), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dim", [32, 64, 128])
def test_rope_is_bit_identical_to_the_torch_expression(dim):
    gen = torch.Generator().manual_seed(dim)
    t, heads = 7, 5
    packed = torch.randn(t, heads * dim + 3 * dim, generator=gen)  # q/k plus v, as the fused projection
    x = packed[:, : heads * dim].view(t, heads, dim)
    cos, sin = torch.randn(t, 1, dim, generator=gen), torch.randn(t, 1, dim, generator=gen)
    want = x * cos + torch.roll(x, dim // 2, -1) * sin
    got = native_rope(x, cos, sin)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_rope_refuses_layouts_it_cannot_read():
    with pytest.raises(ValueError, match="unsupported layout"):
        native_rope(torch.randn(2, 3, 16), torch.randn(2, 1, 16), torch.randn(2, 1, 16))


@pytest.mark.parametrize("rows,inter", [(1, 1536), (9, 40)])
def test_silu_mul_matches_torch(rows, inter):
    gen = torch.Generator().manual_seed(inter)
    gate_up = torch.randn(rows, 2 * inter, generator=gen) * 4
    gate_up[0, :6] = torch.tensor([-100.0, -88.0, 0.0, -0.0, 88.0, 100.0])  # exp's overflow and underflow
    got = native_silu_mul(gate_up)
    want = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("dense", [False, True], ids=["cache-only", "cache+dense"])
def test_kv_store_equals_the_index_copies_it_replaces(dense):
    gen = torch.Generator().manual_seed(int(dense))
    heads, tokens, dim, blocks, block = 3, 4, 64, 6, 4
    # Strided [Hkv, T, D] views, as the lean forward hands them over (transposed slices of q/k/v).
    packed = torch.randn(tokens, 9 * dim, generator=gen)
    key = packed[:, 3 * dim : 6 * dim].view(tokens, heads, dim).transpose(0, 1)
    value = packed[:, 6 * dim :].view(tokens, heads, dim).transpose(0, 1)
    cache = torch.randn(2, heads, blocks, block, dim, generator=gen)
    slots = torch.tensor([5, 0, 17, 22])
    want = cache.clone()
    want[0].view(heads, -1, dim).index_copy_(1, slots, key)
    want[1].view(heads, -1, dim).index_copy_(1, slots, value)
    views = None
    if dense:
        keys, values = torch.randn(heads, tokens, 8, dim), torch.randn(heads, tokens, 8, dim)
        index = torch.tensor([3, 8 + 0, 16 + 7, 24 + 2])
        want_k, want_v = keys.clone(), values.clone()
        want_k.view(heads, -1, dim).index_copy_(1, index, key)
        want_v.view(heads, -1, dim).index_copy_(1, index, value)
        views = (keys, values, index)
    assert native_kv_store(key, value, cache, slots, views)
    assert torch.equal(cache, want)
    if dense:
        assert torch.equal(keys, want_k) and torch.equal(values, want_v)


def test_kv_store_declines_layouts_it_cannot_write():
    cache = torch.zeros(2, 1, 2, 4, 32)
    key = torch.randn(1, 2, 32)
    assert not native_kv_store(key.double(), key.double(), cache.double(), torch.tensor([0, 1]), None)
    assert not native_kv_store(key, key, cache, torch.tensor([0, 1], dtype=torch.int32), None)
    assert torch.equal(cache, torch.zeros_like(cache))
