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

:func:`group_int8_argmax` takes a greedy LM head's argmax over an 8-bit
weight without computing every logit in fp32: an int8 screen bounds each
logit, and only the few columns that could hold the maximum are computed
exactly (see its docstring).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch

from omnistage.kernels.native import native_kernels

__all__ = [
    "GROUP", "TILE", "GroupInt8Weight", "argmax_screen_norms", "encode_group_int8", "group_int8_argmax",
    "group_int8_matmul", "group_int8_rows", "quantize_q8_0",
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
    fp16; ``q`` is ``[N / 32, K / 4, 32, 4]`` uint8 holding ``q + 128``
    (``bits`` 8: four consecutive ``k`` of a column in one 32-bit word, as
    VNNI's u8 x s8 dot product reads them) or, with every ``q`` in 0..15,
    ``[N / 32, K / 8, 32]`` int32 words whose nibble ``j`` holds ``q`` at
    ``k = 8 * (k // 8) + j`` (``bits`` 4). Build one with
    :meth:`from_integers`.
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

    @classmethod
    def from_integers(
        cls, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int | None = None
    ) -> GroupInt8Weight:
        """The weight of int8 ``q`` ``[N / 32, K, 32]``, packed as ``bits`` says (by default 4
        where every ``q`` is in 0..15, else 8)."""
        if bits is None:
            bits = 4 if q.min() >= 0 and q.max() <= 15 else 8
        return cls(_pack_words(q) if bits == 4 else _pack_quads(q), d, m, bits)

    def integers(self) -> torch.Tensor:
        """``q`` as int8 ``[N / 32, K, 32]`` (unpacked)."""
        if self.bits == 4:
            return _unpack_words(self.q, dim=1)
        t, quads, c, _ = self.q.shape
        return _unbias(self.q.transpose(2, 3).reshape(t, quads * 4, c))

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


def _pack_quads(q: torch.Tensor) -> torch.Tensor:
    """``[T, K, 32]`` int8 as ``[T, K / 4, 32, 4]`` uint8 ``q + 128`` (see :class:`GroupInt8Weight`).

    One copy, no wider temporaries: flipping the top bit of a byte turns the
    int8 ``q`` into the uint8 ``q + 128`` (a GGUF LM head is tens of MB, and
    freed temporaries of that size stay in the process's heap).
    """
    t, k, c = q.shape
    packed = q.view(t, k // 4, 4, c).transpose(2, 3).contiguous().view(torch.uint8)
    return packed.bitwise_xor_(0x80)


def _unbias(q: torch.Tensor) -> torch.Tensor:
    """Stored uint8 ``q + 128`` back to int8 ``q`` (the top bit flipped back), a new tensor."""
    return q.bitwise_xor(0x80).view(torch.int8)


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
    return GroupInt8Weight.from_integers(q, d.half(), m.half())


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


def _kernel_input(caller: str, x: torch.Tensor, weight: GroupInt8Weight) -> tuple[ctypes.CDLL, torch.Tensor]:
    """The native library and ``x`` as the kernels read it, or ``ValueError`` naming what is wrong."""
    lib = native_kernels()
    assert lib is not None, "a GroupInt8Weight exists only where the native kernels do"
    k = weight.in_features
    if x.dim() != 2 or x.shape[1] != k or x.dtype != torch.float32 or not x.is_cpu:
        raise ValueError(f"{caller}: expected fp32 CPU input [rows, {k}], got {x.dtype} {x.device.type} {tuple(x.shape)}")
    return lib, x.contiguous()


def group_int8_matmul(x: torch.Tensor, weight: GroupInt8Weight) -> torch.Tensor:
    """``x @ w.T`` for fp32 CPU ``x`` ``[M, K]``; ``weight`` from :func:`encode_group_int8`."""
    lib, x = _kernel_input("group_int8_matmul", x, weight)
    k, n, rows = weight.in_features, weight.out_features, x.shape[0]
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
    q = weight.q[tile, :, col]  # [T, K / 8] words, or [T, K / 4, 4] bytes
    q = _unpack_words(q, dim=1) if weight.bits == 4 else _unbias(q.flatten(1))
    d = weight.d[tile, :, col].float().repeat_interleave(GROUP, dim=1)
    m = weight.m[tile, :, col].float().repeat_interleave(GROUP, dim=1)
    return q.float().mul_(d).add_(m)


def argmax_screen_norms(weight: GroupInt8Weight) -> torch.Tensor | None:
    """What :func:`group_int8_argmax` needs beside ``weight``: each row's L2 norm, rounded up to fp32.

    ``None`` where the screen does not apply: not an 8-bit weight without
    offsets (``m`` all zero: GGUF's ``Q8_0``), or no native kernels with
    AVX-512 VNNI here.
    """
    lib = native_kernels()
    if lib is None or not lib.group_int8_argmax_available() or weight.bits != 8 or bool(weight.m.any()):
        return None
    # 16 tiles at a time (all in fp64 would be 8 bytes per weight), into one output allocated first: small
    # results kept between the freed temporaries would leave the heap fragmented, tens of MB retained.
    squares = torch.empty(weight.q.shape[0], TILE, dtype=torch.float64)
    for t in range(0, weight.q.shape[0], 16):
        q = _unbias(weight.q[t : t + 16]).double()  # [16, K / 4, 32, 4]
        d = weight.d[t : t + 16].double().repeat_interleave(GROUP // 4, dim=1).unsqueeze(-1)  # [16, K / 4, 32, 1]
        torch.sum(q.mul_(d).square_(), dim=(1, 3), out=squares[t : t + 16])  # each d * q and its square exact
    norms = squares.sqrt_().reshape(-1)  # [N]
    rounded = norms.float()
    return torch.where(rounded.double() < norms, torch.nextafter(rounded, torch.tensor(float("inf"))), rounded)


def group_int8_argmax(x: torch.Tensor, weight: GroupInt8Weight, norms: torch.Tensor) -> torch.Tensor | None:
    """Each row's first argmax of ``x @ w.T``, as :func:`group_int8_matmul` computes that row alone.

    Exact, and cheaper than the logits: ``x`` is rounded to int8 per group
    of 32 inputs and multiplied by the 8-bit weights with integer dot
    products (about 2.5x the fp32 kernel's speed); by Cauchy-Schwarz each
    exact logit lies within ``|x - x~| * |w_n|`` (plus a margin for fp32
    rounding) of its screened value, so only the columns whose upper bound
    reaches the best lower bound, a few per row, are computed in fp32. A
    row's token does not depend on the other rows of the batch. ``norms``
    from :func:`argmax_screen_norms`. ``None`` where the screen cannot
    answer (a value that is not finite): take the argmax of the logits.
    """
    lib, x = _kernel_input("group_int8_argmax", x, weight)
    k, n = weight.in_features, weight.out_features
    ids = torch.empty(x.shape[0], dtype=torch.int64)
    answered = lib.group_int8_argmax(
        x.data_ptr(), x.shape[0], k, weight.q.data_ptr(), weight.d.data_ptr(), weight.m.data_ptr(),
        norms.data_ptr(), n, ids.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return ids if answered else None
