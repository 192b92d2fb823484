"""Weights in their exact group-int8 form, and the matmul that reads them.

GGUF's ``Q4_1`` and ``Q8_0`` store each run of 32 weights as small integers
``q`` with one fp16 scale ``d`` (and, for ``Q4_1``, an fp16 offset ``m``);
``transformers`` loads such a file by computing ``w = d * q + m`` in fp32.
:func:`encode_group_int8` recovers ``(q, d, m)`` from those fp32 weights
alone, and only when ``fma(d, q, m)`` reproduces every weight bit for bit
with ``d`` and ``m`` fp16 values (as GGUF stores them).
:func:`group_int8_matmul` multiplies by those fp32 weights without storing
them: equal to ``F.linear`` on the fp32 tensor in exact arithmetic, with
roundings of the size a different summation order gives. Where every ``q``
of a weight is in 0..15 (all of a ``Q4_1`` file's) eight of them share a
32-bit word: 0.625 bytes per weight, the GGUF block's size, instead of 4
(``Q8_0``'s range: 1.125). Decode steps, which stream every weight from
memory once per step, take time in proportion.

Both are native kernels (:mod:`omnistage.kernels.native`); where those are
unavailable :func:`encode_group_int8` returns ``None`` and callers keep fp32.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from omnistage.kernels.native import native_kernels

__all__ = [
    "GROUP", "TILE", "GroupInt8Weight", "encode_group_int8", "group_int8_matmul", "group_int8_rows", "quantize_q8_0",
]  # fmt: skip

GROUP = 32  # weights per (d, m) pair, along the input dimension (GGUF's block size)
TILE = 32  # output columns per kernel tile
_MAX_IN_FEATURES = 1 << 14  # the kernel's per-thread panel (kMaxK)
_NIBBLE_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # nibble j of a 4-bit word: bits 4j..4j+3


@dataclass(frozen=True)
class GroupInt8Weight:
    """``w[n, k] = fma(d[n, k // 32], q[n, k], m[n, k // 32])`` for an ``[N, K]`` weight.

    Tiled by 32 output columns so that the kernel reads one input position's
    32 weights as one vector. ``d`` and ``m`` are ``[N / 32, K / 32, 32]``
    fp16; ``q`` is ``[N / 32, K, 32]`` int8 (``bits`` 8) or, with every ``q``
    in 0..15, ``[N / 32, K / 8, 32]`` int32 words whose nibble ``j`` holds
    ``q`` at ``k = 8 * (k // 8) + j`` (``bits`` 4).
    """

    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor
    bits: int
    # Derived once: a decode step makes ~120 matmul calls, whose Python cost is part of its time.
    out_features: int = field(init=False)
    in_features: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "out_features", self.q.shape[0] * TILE)
        object.__setattr__(self, "in_features", self.d.shape[1] * GROUP)

    def integers(self) -> torch.Tensor:
        """``q`` as int8 ``[N / 32, K, 32]`` (the 4-bit words unpacked)."""
        return self.q if self.bits == 8 else _unpack_words(self.q, dim=1)

    def dequantize(self) -> torch.Tensor:
        """The fp32 ``[N, K]`` weight (``d * q`` is exact in fp32, so ``+ m`` rounds once, like fma)."""
        d = self.d.float().repeat_interleave(GROUP, dim=1)
        m = self.m.float().repeat_interleave(GROUP, dim=1)
        w = d * self.integers().float() + m  # [N / 32, K, 32]
        return w.transpose(1, 2).reshape(self.out_features, self.in_features)


def _pack_words(q: torch.Tensor) -> torch.Tensor:
    """``[T, K, 32]`` integers in 0..15 as ``[T, K / 8, 32]`` int32 words (see :class:`GroupInt8Weight`)."""
    t, k, c = q.shape
    nibbles = q.view(t, k // 8, 8, c).to(torch.int64) << _NIBBLE_SHIFTS.view(1, 1, 8, 1).to(torch.int64)
    words = nibbles.sum(2)  # disjoint bits, so the sum is their OR: below 2**32
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the same 32 bits, signed


def _unpack_words(words: torch.Tensor, dim: int) -> torch.Tensor:
    """int8 ``q`` from 4-bit words: each word along ``dim`` becomes its 8 nibbles, lowest first."""
    shape = [1] * (words.dim() + 1)
    shape[dim + 1] = 8
    nibbles = (words.unsqueeze(dim + 1) >> _NIBBLE_SHIFTS.view(shape)) & 15
    return nibbles.flatten(dim, dim + 1).to(torch.int8)


def encode_group_int8(weight: torch.Tensor) -> GroupInt8Weight | None:
    """The exact group-int8 form of an fp32 CPU ``[N, K]`` weight, or ``None``.

    ``None`` when the weight has no such form (one group that does not fit
    ends the search), its shape is not a multiple of 32, or the native
    kernels are unavailable. Each group is tried as ``Q4_1`` (``m`` = its
    minimum, ``q`` in 0..15) and as ``Q8_0`` (``m = 0``, ``q`` in -127..127),
    with ``d`` an fp16 value; ``m`` must be one too. The 4-bit layout is
    taken when every ``q`` is in 0..15.
    """
    lib = native_kernels()
    if lib is None or weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    n, k = weight.shape
    if n == 0 or n % TILE or k == 0 or k % GROUP or k > _MAX_IN_FEATURES:
        return None
    w = weight.detach().contiguous()
    q = torch.empty((n // TILE, k, TILE), dtype=torch.int8)
    d = torch.empty((n // TILE, k // GROUP, TILE), dtype=torch.float32)
    m = torch.empty_like(d)
    exact = lib.group_int8_encode(
        w.data_ptr(), n, k, q.data_ptr(), d.data_ptr(), m.data_ptr(), torch.get_num_threads()
    )  # fmt: skip
    if not exact or not torch.equal(m.half().float(), m):
        return None
    if q.min() >= 0 and q.max() <= 15:
        return GroupInt8Weight(_pack_words(q), d.half(), m.half(), bits=4)
    return GroupInt8Weight(q, d.half(), m.half(), bits=8)


def quantize_q8_0(weight: torch.Tensor) -> GroupInt8Weight | None:
    """An fp32 CPU ``[N, K]`` weight quantized as GGUF's ``Q8_0`` quantizes it, in the group-int8 form.

    Lossy, unlike :func:`encode_group_int8`: each run of 32 inputs gets
    ``d = amax / 127`` (stored as fp16) and ``q = round(w * (1 / d))``, halves
    away from zero, in fp32 as ggml's reference does, so the weights are
    the ones a ``Q8_0`` file of this tensor dequantizes to (tested against
    the ``gguf`` package). For weights whose rounding costs quality, never
    exactness (an EAGLE head's: its drafts are verified). ``None`` where the
    form does not apply (shape, dtype, no native kernels).
    """
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.shape[1] % GROUP:
        return None
    groups = weight.detach().reshape(weight.shape[0], -1, GROUP)
    d = groups.abs().amax(-1, keepdim=True) / 127
    scaled = groups * torch.where(d == 0, 0.0, 1.0 / d)
    q = scaled.sign() * (scaled.abs() + 0.5).floor()
    d16 = d.half().float()
    if not torch.isfinite(d16).all():
        return None
    return encode_group_int8((q * d16).reshape(weight.shape))


def group_int8_matmul(x: torch.Tensor, weight: GroupInt8Weight) -> torch.Tensor:
    """``x @ w.T`` for fp32 CPU ``x`` ``[M, K]``; ``weight`` from :func:`encode_group_int8`."""
    lib = native_kernels()
    assert lib is not None, "a GroupInt8Weight exists only where the native kernels do"
    k, n = weight.in_features, weight.out_features
    if x.dim() != 2 or x.shape[1] != k or x.dtype != torch.float32 or not x.is_cpu:
        raise ValueError(
            f"group_int8_matmul: expected fp32 CPU input [rows, {k}], got {x.dtype} {x.device.type} {tuple(x.shape)}"
        )
    x = x.contiguous()
    rows = x.shape[0]
    out = torch.empty((rows, n), dtype=torch.float32)
    lib.group_int8_gemm(
        x.data_ptr(), rows, k, weight.q.data_ptr(), weight.bits, weight.d.data_ptr(), weight.m.data_ptr(),
        out.data_ptr(), n, torch.get_num_threads(),
    )  # fmt: skip
    return out


def group_int8_rows(weight: GroupInt8Weight, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of the fp32 weight, ``[len(ids), K]``: an embedding lookup on the int8 form.

    Bit-identical to ``weight.dequantize()[ids]`` (``d * q`` is exact, ``+ m``
    rounds once), reading only the rows asked for.
    """
    ids = ids.reshape(-1).to(torch.int64)
    tile, col = ids // TILE, ids % TILE
    q = weight.q[tile, :, col]  # [T, K] int8, or [T, K / 8] words
    if weight.bits == 4:
        q = _unpack_words(q, dim=1)
    d = weight.d[tile, :, col].float().repeat_interleave(GROUP, dim=1)
    m = weight.m[tile, :, col].float().repeat_interleave(GROUP, dim=1)
    return q.float().mul_(d).add_(m)
