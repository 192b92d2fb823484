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
A read is one ``index_select`` of whole ``block_size * head_dim`` rows of
the ``[num_kv_heads * num_blocks, ...]`` view, with row ids made once per step.

Decode and verify steps that continue the previous step's batch skip that
read: each layer keeps a :class:`DenseDecodeView`, the batch's keys/values
laid out contiguously, and only appends the new tokens to it.
"""

from __future__ import annotations

import math
import mmap
import weakref
from dataclasses import dataclass

import torch

from omnistage import envs


def allocate_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> LayerCaches:
    """One ``[2, num_kv_heads, num_blocks, block_size, head_dim]`` tensor per layer (``LayerCaches``).

    Zero-filled, not ``empty``: a read gathers whole blocks and masks the
    unused tail, and a masked NaN left over in uninitialised memory would
    still poison the output (``0 * NaN == NaN`` in the value product).
    On CPU the zeros are the OS's: fresh anonymous pages, which become
    resident only once written, so the pool costs memory as blocks fill
    rather than its whole budget at start.
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
    shape = (num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim)
    if torch.device(device).type == "cpu":
        pool = _lazy_cpu_zeros(shape, dtype)
    else:
        pool = torch.zeros(shape, dtype=dtype, device=device)
    return LayerCaches(pool)


class LayerCaches(list):
    """Every layer's KV cache (``[2, num_kv_heads, num_blocks, block_size, head_dim]``
    each), views of one ``pool`` tensor with the layers first: what touches a block
    in every layer (``zero_blocks``) is one call over the pool."""

    def __init__(self, pool: torch.Tensor) -> None:
        super().__init__(pool.unbind(0))
        self.pool = pool


def _lazy_cpu_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor on an anonymous mapping (the tensor keeps the mapping alive)."""
    numel = math.prod(shape)
    buffer = mmap.mmap(-1, max(1, numel * torch.empty((), dtype=dtype).element_size()))
    return torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)


def zero_blocks(caches: LayerCaches, block_ids: list[int]) -> None:
    """Zero these blocks in every layer's cache.

    A block given to a request holds what its last owner left, and a read that
    gathers whole blocks masks their unused tail: a NaN left there (a request
    whose activations overflowed) would poison the new owner's output as
    uninitialised memory would. About 35 us per block of the embedded default
    (30 layers, 0.7 MB) on a CPU.
    """
    if block_ids:
        caches.pool.index_fill_(3, torch.tensor(block_ids, dtype=torch.long, device=caches.pool.device), 0)


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


def flat_block_rows(block_ids: torch.Tensor, num_kv_heads: int, num_blocks: int) -> torch.Tensor:
    """Row ids, in a cache half viewed ``[num_kv_heads * num_blocks, block_size * head_dim]``,
    of ``block_ids`` for every head (head-major): what :func:`gather_kv` takes."""
    heads = torch.arange(num_kv_heads, device=block_ids.device) * num_blocks
    return (heads[:, None] + block_ids.to(torch.int64)[None, :]).reshape(-1)


def gather_kv(cache: torch.Tensor, rows: torch.Tensor, num_seqs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Read whole blocks per sequence: contiguous ``[num_kv_heads, num_seqs, L, head_dim]`` twice.

    ``rows`` is :func:`flat_block_rows` of the flattened ``[num_seqs,
    blocks_per_seq]`` block table, so ``L = blocks_per_seq * block_size``;
    positions past each sequence's length are left for the caller's mask.
    Selecting whole contiguous rows along dim 0 is index_select's plain-copy
    path, measured ~10% faster than selecting blocks along dim 1.
    """
    heads, num_blocks, dim = cache.shape[1], cache.shape[2], cache.shape[-1]
    keys = cache[0].view(heads * num_blocks, -1).index_select(0, rows).view(heads, num_seqs, -1, dim)
    values = cache[1].view(heads * num_blocks, -1).index_select(0, rows).view(heads, num_seqs, -1, dim)
    return keys, values


# -- dense decode views ---------------------------------------------------------

DENSE_DECODE_ENV = envs.DENSE_DECODE_BYTES.name
# Its budget (default in omnistage.envs) is in bytes over all layers and caches, for dense decode
# views (0 turns them off). A layer's view is also never larger than that layer's paged cache.
# Free key columns a view is built with, so it is rebuilt only every this many decode steps.
DENSE_DECODE_MARGIN = 64


@dataclass(eq=False)
class DenseDecodeView:
    """One layer's keys/values of a running decode batch, kept contiguous across steps.

    A step of a few tokens per request (decode, speculative verify) whose
    requests are exactly those of this layer's previous step, in the same
    rows, each one further along (``StepRows.follows``: a verify step's
    rejected drafts may roll a row back within what the previous step
    wrote), reads its context from here and only appends its new tokens;
    any other step invalidates the view. That saves the whole-context gather
    per layer and step, the largest part of batched decode attention.
    """

    key: object | None = None  # StepRows of the last step this layer ran
    keys: torch.Tensor | None = None  # [Hkv, R, capacity, D]
    values: torch.Tensor | None = None
    valid: bool = False  # keys/values hold the context of ``key``'s step

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return 2 * self.keys.numel() * self.keys.element_size()


# Every view, for the byte budget; a view lives as long as its cache tensor (an attribute of it).
_all_views: weakref.WeakSet[DenseDecodeView] = weakref.WeakSet()
_ATTR = "_omnistage_dense_view"


def dense_view(cache: torch.Tensor) -> DenseDecodeView:
    """The dense decode view of one layer's cache tensor (made empty on first use)."""
    view = getattr(cache, _ATTR, None)
    if view is None:
        view = DenseDecodeView()
        setattr(cache, _ATTR, view)
        _all_views.add(view)
    return view


def invalidate_dense_view(cache: torch.Tensor) -> None:
    """A step that is not a plain decode continuation ran on ``cache``."""
    view = getattr(cache, _ATTR, None)
    if view is not None:
        view.key = None
        view.valid = False


def release_dense_view(cache: torch.Tensor) -> None:
    """Invalidate ``cache``'s dense view and free its buffers (the next decode batch builds its own)."""
    invalidate_dense_view(cache)
    view = getattr(cache, _ATTR, None)
    if view is not None:
        view.keys = view.values = None


def dense_budget() -> int:
    return envs.dense_decode_bytes()


def dense_bytes_in_use() -> int:
    return sum(v.nbytes for v in list(_all_views))


def build_dense_view(
    view: DenseDecodeView, cache: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_size: int
) -> DenseDecodeView | None:
    """Copy gathered ``[Hkv, R, L, D]`` keys/values into ``view`` (reusing its buffers when they
    fit), with :data:`DENSE_DECODE_MARGIN` spare columns; ``None`` when it would be larger than
    ``cache`` or go over the byte budget."""
    heads, rows, length, dim = keys.shape
    fits = (
        view.keys is not None
        and view.keys.shape[:2] == (heads, rows)
        and view.keys.shape[2] >= length
        and view.keys.dtype == keys.dtype
    )
    if not fits:
        capacity = -(-(length + DENSE_DECODE_MARGIN) // block_size) * block_size
        need = 2 * heads * rows * capacity * dim * keys.element_size()
        too_big = need > cache.numel() * cache.element_size()
        if too_big or dense_bytes_in_use() - view.nbytes + need > dense_budget():
            view.keys = view.values = None
            view.valid = False
            return None
        # Ordinary tensors even under inference_mode, so any later mode may append to them.
        # Zeroed, not empty: a short row's columns up to kv_len are read and masked, and
        # garbage there could be NaN, which a mask does not cancel (NaN - inf, 0 * NaN).
        with torch.inference_mode(False):
            view.keys = torch.zeros((heads, rows, capacity, dim), dtype=keys.dtype, device=keys.device)
            view.values = torch.zeros_like(view.keys)
    view.keys[:, :, :length].copy_(keys)
    view.values[:, :, :length].copy_(values)
    view.valid = True
    return view
