"""The lean decoder's elementwise steps as single native calls (fp32 on CPU).

Each replaces a chain of small torch ops whose dispatch costs more than
their arithmetic at decode sizes (``csrc/decode_ops.cpp``):

- :func:`native_rms_norm`: HF's RMSNorm (square, mean, add eps, rsqrt,
  scale, weight); only the order in which the squares are summed differs;
- :func:`native_rope`: ``x * cos + roll(x, D/2, -1) * sin``, bit-identical;
- :func:`native_silu_mul`: ``silu(gate) * up``, with ``exp`` rounded by the
  kernels' own ``exp`` (within an ulp or two of torch's).

Callers check :func:`omnistage.kernels.native.native_kernels` first; these
functions assume it is not ``None``.
"""

from __future__ import annotations

import torch

from omnistage.kernels.native import native_kernels

__all__ = ["native_rms_norm", "native_rope", "native_silu_mul"]


def native_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of fp32 ``x`` ``[M, K]`` (made contiguous) times ``weight`` ``[K]``."""
    x = x.contiguous()
    out = torch.empty_like(x)
    native_kernels().rms_norm(
        x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), eps, out.data_ptr(), torch.get_num_threads()
    )
    return out


def native_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of ``x`` ``[T, H, D]`` (``D % 32 == 0``; heads contiguous, any row stride) with the
    ``[T, 1, D]`` tables of :meth:`LeanDecoder.rope_tables`; contiguous ``[T, H, D]`` out."""
    t, heads, dim = x.shape
    if x.stride()[1:] != (dim, 1) or dim % 32 or not cos.is_contiguous() or not sin.is_contiguous():
        raise ValueError(f"native_rope: unsupported layout {tuple(x.shape)} strides {x.stride()}")
    out = torch.empty((t, heads, dim), dtype=x.dtype)
    native_kernels().rope(
        x.data_ptr(), t, heads, dim, x.stride(0), cos.data_ptr(), sin.data_ptr(), out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def native_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate_up[:, :I]) * gate_up[:, I:]`` for fp32 ``[M, 2I]`` (made contiguous)."""
    gate_up = gate_up.contiguous()
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, inter), dtype=gate_up.dtype)
    native_kernels().silu_mul(gate_up.data_ptr(), rows, inter, out.data_ptr(), torch.get_num_threads())
    return out
