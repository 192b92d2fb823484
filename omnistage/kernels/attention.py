"""Decode attention on the native kernel: one query token per sequence, fp32 on CPU.

For a batch of single-token queries torch's path is two batched matmuls of
tiny matrices plus a softmax, a mask and the layout copies around them; the
kernel (``csrc/decode_attention.cpp``) does each (KV head, sequence) pair's
scores, softmax and weighted sum in one pass over that sequence's own keys,
so rows of different lengths need no mask. Results differ from torch's in
summation order and ``exp`` rounding only.
"""

from __future__ import annotations

import torch

from omnistage.kernels.native import native_kernels

__all__ = ["native_decode_attention"]


def native_decode_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seq_lens: torch.Tensor, scale: float
) -> torch.Tensor | None:
    """``[R, H, D]`` attention output, or ``None`` where the kernel does not apply.

    ``query`` is ``[H, R, D]`` (any strides with contiguous head rows),
    ``keys``/``values`` ``[Hkv, R, S, D]`` with contiguous ``[S, D]`` rows per
    sequence (e.g. a slice of a longer dense view), and sequence ``r`` reads
    its first ``seq_lens[r]`` keys (int64, ``<= S``).
    """
    lib = native_kernels()
    num_heads, num_seqs, dim = query.shape
    num_kv_heads = keys.shape[0]
    if (
        lib is None
        or query.dtype != torch.float32
        or not query.is_cpu
        or dim not in (32, 64, 128)
        or num_heads % num_kv_heads
        or query.stride(2) != 1
        or keys.stride() != values.stride()
        or keys.stride()[2:] != (dim, 1)
        or seq_lens.dtype != torch.int64
        or not seq_lens.is_contiguous()
    ):
        return None
    out = torch.empty((num_seqs, num_heads, dim), dtype=torch.float32)
    done = lib.decode_attention(
        query.data_ptr(), query.stride(1), query.stride(0), keys.data_ptr(), values.data_ptr(),
        keys.stride(0), keys.stride(1), seq_lens.data_ptr(), num_seqs, num_heads, num_kv_heads, dim,
        scale, out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out if done else None
