"""The group-int8 weight form and its native matmul, against GGUF's own (de)quantizer and fp64 math."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import omnistage.kernels.native as native
from omnistage.kernels.group_int8 import (
    GroupInt8Weight,
    encode_group_int8,
    group_int8_matmul,
    group_int8_rows,
    quantize_q8_0,
)

pytestmark = pytest.mark.skipif(native.native_kernels() is None, reason="native kernels need x86-64 AVX2 and g++")

Q4_1, Q8_0 = gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0


def gguf_weight(shape: tuple[int, int], kind: gguf.GGMLQuantizationType, seed: int = 0) -> torch.Tensor:
    """fp32 weights exactly as loading a GGUF file of ``kind`` gives them."""
    w = np.random.default_rng(seed).normal(0, 0.05, size=shape).astype(np.float32)
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w, kind), kind).reshape(shape))


@pytest.mark.parametrize("kind", [Q4_1, Q8_0], ids=["q4_1", "q8_0"])
@pytest.mark.parametrize("shape", [(32, 32), (96, 160), (256, 1536)])
def test_encode_reproduces_every_weight_bit_for_bit(kind, shape):
    w = gguf_weight(shape, kind)
    enc = encode_group_int8(w)
    assert enc is not None
    assert (enc.out_features, enc.in_features) == shape
    assert torch.equal(enc.dequantize().view(torch.int32), w.view(torch.int32))


def test_a_q8_0_weight_with_a_constant_group_keeps_its_form():
    """A group of 32 equal weights fits Q4_1 with d = 0 only if its value is an fp16 one (Q4_1's
    offset is stored so): otherwise it is Q8_0's, and the weight is not refused as a whole."""
    w = np.random.default_rng(0).normal(0, 0.05, size=(64, 64)).astype(np.float32)
    w[5, 32:] = 0.3  # Q8_0 stores it as 127 * d, which fp16 cannot hold
    w = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w, Q8_0), Q8_0).reshape(64, 64))
    assert w[5, 40].half().float() != w[5, 40]
    enc = encode_group_int8(w)
    assert enc is not None and torch.equal(enc.dequantize().view(torch.int32), w.view(torch.int32))


def test_encode_takes_transposed_views_and_mixed_layouts():
    # Rows of both layouts in one matrix (as a fused q/k/v or gate/up weight of mixed files would be).
    w = torch.cat([gguf_weight((64, 96), Q4_1), gguf_weight((32, 96), Q8_0, seed=1)])
    view = w.t().contiguous().t()  # the lean forward's transposed storage
    enc = encode_group_int8(view)
    assert enc is not None and torch.equal(enc.dequantize(), w)


def test_encode_refuses_weights_without_the_form():
    assert encode_group_int8(torch.randn(64, 64)) is None
    w = gguf_weight((64, 64), Q4_1)
    w[37, 11] = torch.nextafter(w[37, 11], torch.tensor(1.0))  # one weight one ulp off
    assert encode_group_int8(w) is None
    assert encode_group_int8(gguf_weight((48, 64), Q4_1)) is None  # rows not a multiple of 32
    assert encode_group_int8(gguf_weight((64, 64), Q4_1).double()) is None
    assert encode_group_int8(gguf_weight((64, 64), Q4_1).to(torch.bfloat16)) is None


@pytest.mark.parametrize("kind", [Q4_1, Q8_0], ids=["q4_1", "q8_0"])
def test_rows_are_the_fp32_rows_bit_for_bit(kind):
    # The embedding lookup on a tied int8 LM head: any ids, repeats, every tile column.
    w = gguf_weight((96, 160), kind)
    ids = torch.tensor([0, 31, 32, 95, 5, 5, 64])
    got = group_int8_rows(encode_group_int8(w), ids)
    assert torch.equal(got.view(torch.int32), w[ids].view(torch.int32))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 13, 32, 64, 200])
@pytest.mark.parametrize("kind", [Q4_1, Q8_0], ids=["q4_1", "q8_0"])
def test_matmul_matches_fp32_linear_on_the_same_weights(rows, kind):
    w = gguf_weight((160, 288), kind, seed=rows)
    x = torch.randn(rows, 288, generator=torch.Generator().manual_seed(rows))
    enc = encode_group_int8(w)
    got = group_int8_matmul(x, enc)
    exact = F.linear(x.double(), w.double())
    fp32_err = (F.linear(x, w).double() - exact).abs().max()
    assert got.shape == (rows, 160) and got.dtype == torch.float32
    # Only the summation order differs from an fp32 matmul: errors of the same size.
    assert (got.double() - exact).abs().max() <= 4 * fp32_err + 1e-6


@pytest.mark.parametrize("kind", [Q4_1, Q8_0], ids=["q4_1", "q8_0"])
def test_up_to_16_rows_each_row_is_its_one_row_product_bit_for_bit(kind):
    # What lets a speculative verify step of up to 16 tokens compute what decoding them would.
    enc = encode_group_int8(gguf_weight((96, 1536), kind, seed=3))
    x = torch.randn(16, 1536, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([group_int8_matmul(x[r : r + 1], enc) for r in range(16)])
    for rows in (2, 7, 8, 9, 12, 16):
        assert torch.equal(group_int8_matmul(x[:rows], enc).view(torch.int32), alone[:rows].view(torch.int32)), rows


def test_q4_1_weights_take_half_a_byte_per_weight_and_q8_0_a_byte():
    n, k = 96, 160
    q4 = encode_group_int8(gguf_weight((n, k), Q4_1))
    q8 = encode_group_int8(gguf_weight((n, k), Q8_0))
    mixed = encode_group_int8(torch.cat([gguf_weight((64, k), Q4_1), gguf_weight((32, k), Q8_0, seed=1)]))
    assert (q4.bits, q8.bits, mixed.bits) == (4, 8, 8)
    scales = 2 * (n * k // 32) * 2  # fp16 d and m per group of 32
    assert q4.q.numel() * q4.q.element_size() + scales == n * k * 5 // 8  # GGUF Q4_1's 20 bytes per 32 weights
    assert q8.q.numel() * q8.q.element_size() + scales == n * k * 9 // 8
    assert q4.d.dtype == q4.m.dtype == torch.float16


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 9])
def test_4_bit_layout_multiplies_exactly_as_the_8_bit_one(rows):
    # The same integers in both layouts: the nibbles' power-of-two scaling is exact, so the bits agree
    # (every nibble position, the sign bit of the top one included, holds values up to 15 here).
    q4 = encode_group_int8(gguf_weight((64, 256), Q4_1, seed=rows))
    q8 = GroupInt8Weight.from_integers(q4.integers(), q4.d, q4.m, bits=8)
    assert q4.integers().max() == 15 and torch.equal(q8.dequantize(), q4.dequantize())
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
    assert torch.equal(group_int8_matmul(x, q4).view(torch.int32), group_int8_matmul(x, q8).view(torch.int32))


def test_encode_refuses_offsets_that_are_not_fp16():
    # w = d * q + m exactly, d an fp16 value, but m = 1 + 2^-20 has no fp16 form: GGUF never writes it.
    q = torch.arange(32).remainder(16).float().repeat(32, 2)  # every group holds 0..15
    w = q / 64 + (1 + 2**-20)
    assert torch.equal((w - (1 + 2**-20)) * 64, q)  # exact in fp32
    assert encode_group_int8(w) is None
    assert encode_group_int8(q / 64 + 1) is not None  # the same with an fp16 offset


def test_matmul_of_no_rows_is_empty():
    # A step that samples nothing hands the LM head zero rows.
    got = group_int8_matmul(torch.empty(0, 64), encode_group_int8(gguf_weight((96, 64), Q4_1)))
    assert got.shape == (0, 96)


def test_matmul_refuses_input_of_the_wrong_width_or_dtype():
    enc = encode_group_int8(gguf_weight((32, 64), Q4_1))
    with pytest.raises(ValueError, match=r"\[rows, 64\]"):
        group_int8_matmul(torch.randn(3, 32), enc)
    with pytest.raises(ValueError, match="fp32"):
        group_int8_matmul(torch.randn(3, 64).double(), enc)


def test_matmul_reads_non_contiguous_input_and_threads_agree():
    w = gguf_weight((64, 96), Q4_1)
    x = torch.randn(96, 5).t()  # a strided view
    enc = encode_group_int8(w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = group_int8_matmul(x, enc)
        torch.set_num_threads(2)
        two = group_int8_matmul(x, enc)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)  # tiles split across threads, never a row's sum
    torch.testing.assert_close(one, F.linear(x, w), rtol=1e-5, atol=1e-6)


def test_no_compiler_means_no_native_kernels(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("OMNISTAGE_CACHE_DIR", str(tmp_path))  # nothing built there yet
    native.native_kernels.cache_clear()
    try:
        assert native.native_kernels() is None
    finally:
        monkeypatch.undo()
        native.native_kernels.cache_clear()
    assert native.native_kernels() is not None


def test_env_turns_native_kernels_off(monkeypatch):
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    native.native_kernels.cache_clear()
    try:
        assert native.native_kernels() is None
        assert encode_group_int8(gguf_weight((32, 32), Q4_1)) is None
    finally:
        monkeypatch.delenv(native.NATIVE_ENV)
        native.native_kernels.cache_clear()
    assert native.native_kernels() is not None


def test_quantize_q8_0_gives_the_weights_a_gguf_q8_0_file_holds():
    # What gguf-py's (bit-exact with ggml's) Q8_0 quantize-then-dequantize gives, in the group-int8 form.
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    gen = torch.Generator().manual_seed(3)
    w = torch.randn(96, 160, generator=gen) * torch.logspace(-3, 1, 160)  # groups of very different scales
    w[5, 32:64] = 0.0  # a zero group: d = 0
    enc = quantize_q8_0(w)
    assert enc is not None and enc.bits in (4, 8)
    ref = dequantize(quantize(w.numpy(), GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
    assert torch.equal(enc.dequantize(), torch.from_numpy(ref).reshape(w.shape))
    x = torch.randn(3, 160, generator=gen)
    torch.testing.assert_close(group_int8_matmul(x, enc), x @ enc.dequantize().T, rtol=1e-5, atol=1e-5)
    assert quantize_q8_0(w[:, :100]) is None  # inputs not a multiple of 32
