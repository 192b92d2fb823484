"""Decode attention on the native kernel: a few query tokens per sequence, fp32 on CPU.

For a batch of single-token queries (or a speculative verify step's few per
sequence) torch's path is two batched matmuls of tiny matrices plus a
softmax, a mask and the layout copies around them; the kernel
(``csrc/decode_attention.cpp``) does each (KV head, query token) pair's
scores, softmax and weighted sum in one pass over its own sequence's keys up
to its own position, so neither ragged lengths nor causality need a mask.
Query heads that share a KV head go together: each key and value is read
once for all of them, and each head's arithmetic is what it would be alone.
Results differ from torch's in summation order and ``exp`` rounding only,
and a token's result does not depend on the other tokens of its step.
"""

from __future__ import annotations

import torch

from omnistage.kernels.native import native_kernels

__all__ = ["native_decode_attention"]


def native_decode_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_rows: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """``[T, H, D]`` attention output, or ``None`` where the kernel does not apply.

    ``query`` is ``[H, T, D]`` (any strides with contiguous head rows),
    ``keys``/``values`` ``[Hkv, R, S, D]`` with contiguous ``[S, D]`` rows per
    sequence (e.g. a slice of a longer dense view), and query token ``t``
    reads the first ``seq_lens[t]`` keys (int64, ``<= S``) of sequence
    ``kv_rows[t]`` (int64; ``None``: sequence ``t``, one token per sequence).
    """
    lib = native_kernels()
    num_heads, num_tokens, dim = query.shape
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
        or (kv_rows is not None and (kv_rows.dtype != torch.int64 or not kv_rows.is_contiguous()))
    ):
        return None
    out = torch.empty((num_tokens, num_heads, dim), dtype=torch.float32)
    rows = None if kv_rows is None else kv_rows.data_ptr()
    done = lib.decode_attention(
        query.data_ptr(), query.stride(1), query.stride(0), keys.data_ptr(), values.data_ptr(), keys.stride(0),
        keys.stride(1), rows, seq_lens.data_ptr(), num_tokens, num_heads, num_kv_heads, dim, scale, out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return out if done else None
