"""The screened greedy argmax over 8-bit weights, against each row's logits computed alone."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import omnistage.kernels.native as native
from omnistage.kernels.group_int8 import (
    argmax_screen_norms,
    encode_group_int8,
    group_int8_argmax,
    group_int8_matmul,
)

_lib = native.native_kernels()
pytestmark = pytest.mark.skipif(
    _lib is None or not _lib.group_int8_argmax_available(), reason="the screen needs AVX-512 VNNI and g++"
)

Q4_1, Q8_0 = gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0


def gguf_weight(w: np.ndarray, kind: gguf.GGMLQuantizationType = Q8_0) -> torch.Tensor:
    """fp32 weights exactly as loading a GGUF file of ``kind`` gives them."""
    w = w.astype(np.float32)
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w, kind), kind).reshape(w.shape))


def alone(x: torch.Tensor, weight) -> torch.Tensor:
    """Each row's first argmax, its logits computed by the matmul kernel one row at a time."""
    return torch.cat([group_int8_matmul(x[r : r + 1], weight).max(-1).indices for r in range(x.shape[0])])


def screened(x: torch.Tensor, weight) -> torch.Tensor:
    ids = group_int8_argmax(x, weight, argmax_screen_norms(weight))
    assert ids is not None
    return ids


@settings(max_examples=40, deadline=None)
@given(
    tiles=st.integers(1, 40), groups=st.integers(1, 12), rows=st.integers(1, 21),
    outliers=st.integers(0, 3), seed=st.integers(0, 2**16),
)  # fmt: skip
def test_screen_equals_each_rows_own_argmax(tiles, groups, rows, outliers, seed):
    rng = np.random.default_rng(seed)
    n, k = 32 * tiles, 32 * groups
    weight = encode_group_int8(gguf_weight(rng.normal(0, 0.05, (n, k))))
    x = torch.from_numpy(rng.normal(0, 1, (rows, k)).astype(np.float32))
    x[:, rng.integers(0, k, outliers)] *= 40  # outlier channels, as final-norm hidden states have
    assert torch.equal(screened(x, weight), alone(x, weight))


def test_ties_go_to_the_first_column_and_near_ties_to_the_larger_logit():
    rng = np.random.default_rng(7)
    n, k = 2048, 576
    w = gguf_weight(rng.normal(0, 0.05, (n, k)))
    x = torch.from_numpy(rng.normal(0, 1, (3, k)).astype(np.float32))
    # Row 1's input 10 rounds to 0 in the int8 screen (0.4 of its group's step), so columns 100 and
    # 1700, which differ only in their weight there, screen alike; 1700's exact logit is ahead.
    x[1, 10] = 0.4 * x[1, :32].abs().max() / 127
    # Column 1500 is row 0's own direction, so it leads by far; column 900 is a copy of it: a tie.
    w[1500] = gguf_weight(x[0].numpy()[None] * 0.1)[0]
    w[900] = w[1500]
    w[100] = gguf_weight(x[1].numpy()[None] * 0.1)[0]
    weight = encode_group_int8(w)
    q, d = weight.integers(), weight.d
    (t, c), (src_t, src_c) = divmod(1700, 32), divmod(100, 32)
    q[t, :, c], d[t, :, c] = q[src_t, :, src_c], d[src_t, :, src_c]
    q[t, 10, c] += 50
    weight = type(weight).from_integers(q, d, weight.m, bits=8)
    ids = screened(x, weight)
    assert torch.equal(ids, alone(x, weight))
    assert ids[:2].tolist() == [900, 1700]


def test_rows_with_values_that_are_not_finite_are_left_to_the_logits():
    rng = np.random.default_rng(3)
    weight = encode_group_int8(gguf_weight(rng.normal(0, 0.05, (256, 128))))
    norms = argmax_screen_norms(weight)
    for bad in (float("nan"), float("inf")):
        x = torch.randn(4, 128)
        x[2, 5] = bad
        assert group_int8_argmax(x, weight, norms) is None


def test_screen_takes_only_offset_free_8_bit_weights_with_norms_rounded_up():
    rng = np.random.default_rng(5)
    w = rng.normal(0, 0.05, (128, 256))
    assert argmax_screen_norms(encode_group_int8(gguf_weight(w, Q4_1))) is None  # offsets (and 4-bit)
    weight = encode_group_int8(gguf_weight(w))
    norms = argmax_screen_norms(weight)
    exact = weight.dequantize().double().norm(dim=1)
    assert (norms.double() >= exact).all()
    assert torch.equal(norms, exact.float()) or (norms.double() - exact <= exact * 2**-23).all()
    with pytest.raises(ValueError, match=r"expected fp32 CPU input \[rows, 256\]"):
        group_int8_argmax(torch.randn(2, 128), weight, norms)
