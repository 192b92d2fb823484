"""Paged KV storage: one block-shaped tensor per attention layer.

Layout per layer: ``[2, num_kv_heads, num_blocks, block_size, head_dim]``
(keys at index 0, values at index 1). A token's *slot* is
``block_id * block_size + offset``; viewing one half as
``[num_kv_heads, num_blocks * block_size, head_dim]`` turns a slot into a
column index, so a step writes all its new tokens with one ``index_copy_``
and reads whole blocks back with one ``index_select`` per tensor.

Heads come first (not blocks) so that a read lands directly in the
``[num_kv_heads, num_seqs, seq_len, head_dim]`` layout attention multiplies
with, with no transpose copy: HF hands us keys as ``[heads, tokens, dim]``,
and batched matmuls over a non-contiguous batch of sequences were measured
to be much slower on CPU than the extra index arithmetic this layout avoids.
"""

from __future__ import annotations

import torch


def allocate_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[torch.Tensor]:
    """One ``[2, num_kv_heads, num_blocks, block_size, head_dim]`` tensor per layer.

    Zero-filled, not ``empty``: a read gathers whole blocks and masks the
    unused tail, and a masked NaN left over in uninitialised memory would
    still poison the output (``0 * NaN == NaN`` in the value product).
    """
    for name, value in (
        ("num_layers", num_layers),
        ("num_blocks", num_blocks),
        ("block_size", block_size),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
    ):
        if value < 1:
            raise ValueError(f"allocate_kv_caches: {name} must be >= 1, got {value}")
    shape = (2, num_kv_heads, num_blocks, block_size, head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]


def kv_cache_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes one block costs across all layers (keys and values), for sizing the pool."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize


def write_kv(
    cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slots: torch.Tensor,
    token_index: torch.Tensor | None,
) -> None:
    """Store new keys/values ``[num_kv_heads, T, head_dim]`` at ``slots``.

    ``token_index`` selects the tokens that have a slot (``None``: all of
    them), so tokens whose slot is -1 are skipped without a per-token branch.
    """
    if token_index is not None:
        key = key.index_select(1, token_index)
        value = value.index_select(1, token_index)
    heads, dim = cache.shape[1], cache.shape[-1]
    cache[0].view(heads, -1, dim).index_copy_(1, slots, key)
    cache[1].view(heads, -1, dim).index_copy_(1, slots, value)


def gather_kv(cache: torch.Tensor, block_ids: torch.Tensor, num_seqs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Read whole blocks per sequence: contiguous ``[num_kv_heads, num_seqs, L, head_dim]`` twice.

    ``block_ids`` is the flattened ``[num_seqs, blocks_per_seq]`` table, so
    ``L = blocks_per_seq * block_size``; positions past each sequence's
    length are left for the caller's mask.
    """
    heads, dim = cache.shape[1], cache.shape[-1]
    keys = cache[0].index_select(1, block_ids).view(heads, num_seqs, -1, dim)
    values = cache[1].index_select(1, block_ids).view(heads, num_seqs, -1, dim)
    return keys, values
