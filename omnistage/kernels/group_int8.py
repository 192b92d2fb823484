"""Weights in their exact group-int8 form, and the matmul that reads them.

GGUF's ``Q4_1`` and ``Q8_0`` store each run of 32 weights as small integers
``q`` with one fp16 scale ``d`` (and, for ``Q4_1``, an fp16 offset ``m``);
``transformers`` loads such a file by computing ``w = d * q + m`` in fp32.
:func:`encode_group_int8` recovers ``(q, d, m)`` from those fp32 weights
alone, and only when ``fma(d, q, m)`` reproduces every weight bit for bit.
:func:`group_int8_matmul` then rebuilds the same fp32 weights in registers
as it multiplies, so its result differs from ``F.linear`` on the fp32 tensor
only in summation order, while it reads 1.25 instead of 4 bytes per weight:
decode steps, which stream every weight from memory once per step, get
that much less traffic.

Both are native kernels (:mod:`omnistage.kernels.native`); where those are
unavailable :func:`encode_group_int8` returns ``None`` and callers keep fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omnistage.kernels.native import native_kernels

__all__ = ["GROUP", "TILE", "GroupInt8Weight", "encode_group_int8", "group_int8_matmul", "group_int8_rows"]

GROUP = 32  # weights per (d, m) pair, along the input dimension (GGUF's block size)
TILE = 32  # output columns per kernel tile
_MAX_IN_FEATURES = 1 << 14  # the kernel's per-thread panel (kMaxK)


@dataclass(frozen=True)
class GroupInt8Weight:
    """``w[n, k] = fma(d[n, k // 32], q[n, k], m[n, k // 32])`` for an ``[N, K]`` weight.

    Tiled by 32 output columns so that the kernel reads one input position's
    32 weights as one vector: ``q`` is ``[N / 32, K, 32]`` int8, ``d`` and
    ``m`` are ``[N / 32, K / 32, 32]`` fp32.
    """

    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    @property
    def out_features(self) -> int:
        return self.q.shape[0] * TILE

    @property
    def in_features(self) -> int:
        return self.q.shape[1]

    def dequantize(self) -> torch.Tensor:
        """The fp32 ``[N, K]`` weight (``d * q`` is exact in fp32, so ``+ m`` rounds once, like fma)."""
        d = self.d.repeat_interleave(GROUP, dim=1)
        m = self.m.repeat_interleave(GROUP, dim=1)
        w = d * self.q.float() + m  # [N / 32, K, 32]
        return w.transpose(1, 2).reshape(self.out_features, self.in_features)


def encode_group_int8(weight: torch.Tensor) -> GroupInt8Weight | None:
    """The exact group-int8 form of an fp32 CPU ``[N, K]`` weight, or ``None``.

    ``None`` when the weight has no such form (one group that does not fit
    ends the search), its shape is not a multiple of 32, or the native
    kernels are unavailable. Each group is tried as ``Q4_1`` (``m`` = its
    minimum, ``q`` in 0..15) and as ``Q8_0`` (``m = 0``, ``q`` in -127..127),
    with ``d`` an fp16 value.
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
    return GroupInt8Weight(q, d, m) if exact else None


def group_int8_matmul(x: torch.Tensor, weight: GroupInt8Weight) -> torch.Tensor:
    """``x @ w.T`` for fp32 CPU ``x`` ``[M, K]``; ``weight`` from :func:`encode_group_int8`."""
    lib = native_kernels()
    assert lib is not None, "a GroupInt8Weight exists only where the native kernels do"
    if x.dim() != 2 or x.shape[1] != weight.in_features or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(
            f"group_int8_matmul: expected fp32 CPU input [rows, {weight.in_features}], "
            f"got {x.dtype} {x.device.type} {tuple(x.shape)}"
        )
    x = x.contiguous()
    out = torch.empty((x.shape[0], weight.out_features), dtype=torch.float32)
    lib.group_int8_gemm(
        x.data_ptr(), x.shape[0], weight.in_features, weight.q.data_ptr(), weight.d.data_ptr(),
        weight.m.data_ptr(), out.data_ptr(), weight.out_features, torch.get_num_threads(),
    )  # fmt: skip
    return out


def group_int8_rows(weight: GroupInt8Weight, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of the fp32 weight, ``[len(ids), K]``: an embedding lookup on the int8 form.

    Bit-identical to ``weight.dequantize()[ids]`` (``d * q`` is exact, ``+ m``
    rounds once), reading 1.25 bytes per weight of the rows asked for.
    """
    ids = ids.reshape(-1).to(torch.int64)
    tile, col = ids // TILE, ids % TILE
    q = weight.q[tile, :, col]  # [T, K]
    d = weight.d[tile, :, col].repeat_interleave(GROUP, dim=1)
    m = weight.m[tile, :, col].repeat_interleave(GROUP, dim=1)
    return q.float().mul_(d).add_(m)
