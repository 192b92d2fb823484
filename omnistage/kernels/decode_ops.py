"""The lean decoder's elementwise steps as single native calls (fp32 on CPU).

Each replaces a chain of small torch ops whose dispatch costs more than
their arithmetic at decode sizes (``csrc/decode_ops.cpp``):

- :func:`native_rms_norm`: HF's RMSNorm (square, mean, add eps, rsqrt,
  scale, weight); only the order in which the squares are summed differs;
- :func:`native_rope`: ``x * cos + roll(x, D/2, -1) * sin``, bit-identical;
- :func:`native_silu_mul`: ``silu(gate) * up``, with ``exp`` rounded by the
  kernels' own ``exp`` (within an ulp or two of torch's);
- :func:`native_kv_store`: a decode step's new keys/values into the paged
  cache and the layer's dense decode view at once (four ``index_copy_``
  calls before), plain copies.

Callers check :func:`omnistage.kernels.native.native_kernels` first; these
functions assume it is not ``None``.
"""

from __future__ import annotations

import torch

from omnistage.kernels.native import native_kernels

__all__ = ["native_kv_store", "native_rms_norm", "native_rope", "native_silu_mul"]


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
    ``[T, 1, D]`` tables of :func:`omnistage.models.fast_forward.rope_tables`; contiguous ``[T, H, D]`` out."""
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


def native_kv_store(
    key: torch.Tensor,
    value: torch.Tensor,
    cache: torch.Tensor,
    slots: torch.Tensor,
    dense: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> bool:
    """Copy fp32 ``key``/``value`` ``[Hkv, T, D]`` (rows contiguous) to ``slots`` of ``cache``
    ``[2, Hkv, blocks, block_size, D]`` and, with ``dense = (keys, values, index)``, to rows
    ``index`` of the contiguous ``[Hkv, R, capacity, D]`` dense view. ``False`` (nothing
    written) where a layout or dtype does not fit the kernel; the caller copies then."""
    heads, tokens, dim = key.shape
    # Plain checks, no generators: this runs once per layer of every decode step.
    if (
        not (_is_fp32_cpu(key) and _is_fp32_cpu(value) and _is_fp32_cpu(cache) and cache.is_contiguous())
        or key.stride(2) != 1
        or value.stride(2) != 1
        or not _is_index(slots, tokens)
    ):
        return False
    if dense is not None and not (
        _is_fp32_cpu(dense[0]) and _is_fp32_cpu(dense[1]) and dense[0].is_contiguous() and dense[1].is_contiguous()
        and _is_index(dense[2], tokens)
    ):  # fmt: skip
        return False
    dense_k = dense_v = dense_index = None
    dense_hs = 0
    if dense is not None:
        dense_k, dense_v, dense_index = (t.data_ptr() for t in dense)
        dense_hs = dense[0][0].numel()
    native_kernels().kv_store(
        key.data_ptr(), key.stride(0), key.stride(1), value.data_ptr(), value.stride(0), value.stride(1),
        heads, tokens, dim, cache[0].data_ptr(), cache[1].data_ptr(), cache[0][0].numel(), slots.data_ptr(),
        dense_k, dense_v, dense_hs, dense_index,
    )  # fmt: skip
    return True


def _is_fp32_cpu(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.is_cpu


def _is_index(i: torch.Tensor, n: int) -> bool:
    return i.dtype == torch.int64 and i.is_contiguous() and i.numel() == n
