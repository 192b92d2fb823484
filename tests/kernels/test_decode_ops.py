"""The native elementwise decode steps against the torch expressions they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from omnistage.kernels.decode_ops import native_rms_norm, native_rope, native_silu_mul
from omnistage.kernels.native import native_kernels
from omnistage.models.fast_forward import _rms_norm

pytestmark = pytest.mark.skipif(native_kernels() is None, reason="native kernels need x86-64 AVX-512 and g++")


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
