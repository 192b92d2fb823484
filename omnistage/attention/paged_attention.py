"""Paged attention plugged into Hugging Face modeling code.

HF attention modules project q/k/v, apply RoPE from ``position_ids`` and then
call whatever function ``config._attn_implementation`` names in
``transformers.AttentionInterface``. We register :data:`ATTN_IMPL` there, so
any model that follows that interface (Llama, Qwen2, Qwen3, ...) runs over
our paged KV cache without being re-implemented. The name is deliberately
absent from ``AttentionMaskInterface``: ``create_causal_mask`` then returns
``None`` early and HF never builds a dense mask.

The step's packed tokens come in as one "batch" of shape ``[1, heads, T, D]``;
:class:`AttentionMetadata` (built once per step, shared by every layer) holds
the indices and masks that turn that into per-sequence attention.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from omnistage.kernels.attention import native_decode_attention
from omnistage.kernels.decode_ops import native_kv_store
from omnistage.kernels.native import native_kernels
from omnistage.attention.kv_cache import (
    allocate_kv_caches,
    DenseDecodeView,
    build_dense_view,
    dense_view,
    flat_block_rows,
    gather_kv,
    invalidate_dense_view,
    write_kv,
)

__all__ = [
    "ATTN_IMPL",
    "AttentionMetadata",
    "allocate_kv_caches",
    "attention_context",
    "build_attention_metadata",
    "get_attention_context",
    "paged_attention",
    "paged_attention_forward",
]

ATTN_IMPL = "omnistage_paged"

# Step kinds, cheapest first. The kind picks the attention path for every layer.
DECODE = "decode"  # one query per sequence, context read from the cache
PREFILL_SINGLE = "prefill_single"  # one sequence, nothing cached yet: causal SDPA on this step's k/v
PREFILL = "prefill"  # several sequences, nothing cached yet: this step's k/v, padded
MIXED = "mixed"  # anything else: padded queries over each sequence's cached blocks
# Up to this many queries per sequence (decode, speculative verify steps) attention runs as
# two matmuls and a softmax in fp32 rather than the flash kernel (see _attend_cache), and the
# step may continue the previous step's dense decode views.
SMALL_QUERY_LEN = 16


@dataclass(frozen=True)
class StepRows:
    """Which request each row of a step holds and how far it gets: what a dense decode view
    records of the last step that ran on it, to tell whether the next step continues it."""

    req_ids: tuple[str, ...]
    computed: tuple[int, ...]  # context per row before the step
    seq_lens: tuple[int, ...]  # and after it
    # The last answer of follows(): every layer asks about the same previous step.
    _last: tuple[object, bool] | None = field(default=None, compare=False, repr=False)
    _row_of: dict[str, int] | None = field(default=None, compare=False, repr=False)  # request -> row

    def follows(self, prev: StepRows | None) -> bool:
        """Whether this step continues ``prev``: the same requests in the same rows, each one
        starting past where it started in ``prev`` and no later than where ``prev`` left it.
        Starting earlier than that is a verify step's rejected drafts rolled back: their
        columns are rewritten before any token reads them."""
        if self._last is not None and self._last[0] is prev:
            return self._last[1]
        result = prev is not None and prev.req_ids == self.req_ids and self.rows_in(prev) is not None
        object.__setattr__(self, "_last", (prev, result))
        return result

    def rows_in(self, prev: StepRows | None) -> np.ndarray | None:
        """Each request's row in ``prev`` where every one of them continues there as
        :meth:`follows` asks, else ``None``: a step whose requests are some of ``prev``'s
        (the others finished, were preempted or sat the step out) continues in their rows."""
        if prev is None:
            return None
        if prev._row_of is None:
            object.__setattr__(prev, "_row_of", {r: j for j, r in enumerate(prev.req_ids)})
        rows = []
        for req, c in zip(self.req_ids, self.computed):
            j = prev._row_of.get(req)
            if j is None or not prev.computed[j] < c <= prev.seq_lens[j]:
                return None
            rows.append(j)
        return np.array(rows, dtype=np.int64)

    def advanced(self, rows: np.ndarray, step: StepRows) -> StepRows:
        """These rows after ``step``, whose requests are at ``rows`` (:meth:`rows_in`): those
        moved to where ``step`` leaves them, the rest as they were."""
        computed, seq_lens = list(self.computed), list(self.seq_lens)
        for j, c, n in zip(rows.tolist(), step.computed, step.seq_lens):
            computed[j], seq_lens[j] = c, n
        return StepRows(self.req_ids, tuple(computed), tuple(seq_lens))


@dataclass
class AttentionMetadata:
    """One step's attention inputs, built once and read by every layer.

    Padded layouts have one row per sequence and ``max_query_len`` query
    columns; ``query_index``/``output_index`` map between them and the packed
    tokens (``None`` when every sequence has the same query length, so a
    view suffices). ``attn_mask`` is boolean, True = may attend; rows of
    padding queries still see key 0, so no softmax row is empty.
    """

    kind: str
    num_reqs: int
    num_tokens: int
    block_size: int
    max_query_len: int
    max_seq_len: int
    slot_mapping: torch.Tensor  # [T] int64, -1 = not stored
    query_start_loc: torch.Tensor  # [R + 1]
    seq_lens: torch.Tensor  # [R]
    block_table: torch.Tensor  # [R, max_blocks] int32
    write_slots: torch.Tensor  # slots of the tokens that are stored
    write_token_index: torch.Tensor | None = None  # those tokens, None = all
    gather_block_ids: torch.Tensor | None = None  # [R * blocks_per_seq] int64, for cache reads
    single_kv_len: int | None = None  # one sequence: read exactly this many keys, no mask
    query_index: torch.Tensor | None = None  # [R * Lq] packed token of each padded query
    output_index: torch.Tensor | None = None  # [T] padded row of each packed token
    attn_mask: torch.Tensor | None = None  # [R, 1, Lq, Lk] bool
    kv_len: int = 0  # keys read per sequence from the cache (decode, mixed)
    # Steps of at most SMALL_QUERY_LEN tokens per sequence, every token stored (decode, verify):
    # the rows, to recognise a continuation of the previous step (see kv_cache.DenseDecodeView),
    # and per token the row it belongs to (None: token r is row r, a decode step) and how many
    # keys it reads (its position + 1), for attention without a mask.
    rows: StepRows | None = None
    token_rows: torch.Tensor | None = None  # [T] int64
    token_kv_lens: torch.Tensor | None = None  # [T] int64
    _grouped: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    _dense_index: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    _flat_ids: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict, repr=False)
    _bias: dict[object, torch.Tensor] = field(default_factory=dict, repr=False)

    def flat_gather_ids(self, num_kv_heads: int, num_blocks: int) -> torch.Tensor:
        """``gather_block_ids`` as rows of a cache half viewed ``[heads * num_blocks, block_size * D]``.

        Made by the first layer that asks, then shared: one ``index_select``
        along dim 0 (whole contiguous rows) then reads every head's blocks.
        """
        key = (num_kv_heads, num_blocks)
        ids = self._flat_ids.get(key)
        if ids is None:
            assert self.gather_block_ids is not None
            ids = flat_block_rows(self.gather_block_ids, num_kv_heads, num_blocks)
            self._flat_ids[key] = ids
        return ids

    def dense_index(self, capacity: int) -> torch.Tensor:
        """Column of each new token in a ``[Hkv, R * capacity, D]`` dense view (``rows`` steps)."""
        index = self._dense_index.get(capacity)
        if index is None:
            rows = self.token_rows
            if rows is None:
                rows = torch.arange(self.num_reqs, device=self.seq_lens.device)
            index = self._dense_index[capacity] = rows * capacity + self.token_kv_lens - 1
        return index

    def decode_bias(self, dtype: torch.dtype) -> torch.Tensor | None:
        """``attn_mask`` of a decode step as an additive ``[1, R, 1, Lk]`` bias (0 or -inf)."""
        if self.attn_mask is None:
            return None
        bias = self._bias.get(dtype)
        if bias is None:
            r, _, _, lk = self.attn_mask.shape
            bias = torch.zeros((1, r, 1, lk), dtype=dtype, device=self.attn_mask.device)
            bias.masked_fill_(~self.attn_mask.view(1, r, 1, lk), float("-inf"))
            self._bias[dtype] = bias
        return bias

    def grouped_bias(self, group: int, dtype: torch.dtype) -> torch.Tensor | None:
        """``grouped_mask(group)`` as an additive bias (0 or -inf), made once per step."""
        mask = self.grouped_mask(group)
        if mask is None:
            return None
        bias = self._bias.get((group, dtype))
        if bias is None:
            bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
            self._bias[(group, dtype)] = bias
        return bias

    def grouped_mask(self, group: int) -> torch.Tensor | None:
        """``attn_mask`` for queries laid out as ``[Hkv, R, group * Lq, D]`` (see ``_attend_cache``).

        Made by the first layer that asks, then shared. With one query per
        sequence the ``[1, R, 1, Lk]`` view broadcasts over the group rows.
        """
        if self.attn_mask is None:
            return None
        mask = self._grouped.get(group)
        if mask is None:
            r, _, lq, lk = self.attn_mask.shape
            mask = self.attn_mask.view(1, r, lq, lk)
            if lq > 1 and group > 1:
                mask = mask.unsqueeze(2).expand(1, r, group, lq, lk).reshape(1, r, group * lq, lk)
            self._grouped[group] = mask
        return mask


class StepLayout(Protocol):
    """What attention needs of a step's packed batch (the worker's ``BatchStep`` has it)."""

    num_tokens: int
    input_ids: torch.Tensor
    req_ids: Sequence[str]
    num_scheduled_tokens: np.ndarray
    num_computed_tokens: np.ndarray
    seq_lens: np.ndarray
    query_start_loc: np.ndarray
    slot_mapping: torch.Tensor
    block_table: torch.Tensor


def build_attention_metadata(step: StepLayout, block_size: int) -> AttentionMetadata:
    """Indices and masks for one step, from the host-side arrays of ``step``.

    Everything is computed with numpy on the host and copied once, so the
    layers do no index arithmetic and no host-device synchronisation.
    """
    device = step.input_ids.device
    n = np.asarray(step.num_scheduled_tokens, dtype=np.int64)
    computed = np.asarray(step.num_computed_tokens, dtype=np.int64)
    seq_lens = np.asarray(step.seq_lens, dtype=np.int64)
    qsl = np.asarray(step.query_start_loc, dtype=np.int64)
    r, t = len(n), int(qsl[-1]) if len(qsl) else 0
    if r == 0 or t == 0:
        raise ValueError("build_attention_metadata: the step schedules no tokens")
    max_q, max_seq = int(n.max()), int(seq_lens.max())

    def dev(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    slots = step.slot_mapping.to(torch.int64)
    # The only host read of a device tensor; slot ids are tiny and the step has not started.
    host_slots = (slots if slots.device.type == "cpu" else slots.cpu()).numpy()
    valid = host_slots >= 0
    write_index = None
    write_slots = slots
    if not valid.all():
        keep = np.flatnonzero(valid)
        write_index, write_slots = dev(keep), dev(host_slots[keep])

    if not computed.any():
        kind = PREFILL_SINGLE if r == 1 else PREFILL
    else:
        kind = DECODE if max_q == 1 else MIXED
    md = AttentionMetadata(
        kind=kind,
        num_reqs=r,
        num_tokens=t,
        block_size=block_size,
        max_query_len=max_q,
        max_seq_len=max_seq,
        slot_mapping=slots,
        query_start_loc=dev(qsl),
        seq_lens=dev(seq_lens),
        block_table=step.block_table,
        write_slots=write_slots,
        write_token_index=write_index,
    )
    if kind == PREFILL_SINGLE:
        return md

    cols = np.arange(max_q)
    if kind != DECODE and not (n == max_q).all():
        md.query_index = dev((qsl[:-1, None] + np.minimum(cols[None, :], n[:, None] - 1)).reshape(-1))
        md.output_index = dev(np.repeat(np.arange(r) * max_q - qsl[:-1], n) + np.arange(t))
    if kind == PREFILL:
        # Key j of row i is visible when j <= i, clipped to the row's last real token.
        limit = np.minimum(cols[None, :], n[:, None] - 1)
        if md.query_index is not None:
            md.attn_mask = dev(np.arange(max_q)[None, None, None, :] <= limit[:, None, :, None])
        return md

    blocks_per_seq = -(-max_seq // block_size)
    table = step.block_table
    if table.shape[0] != r or table.shape[1] < blocks_per_seq:
        raise ValueError(
            f"block_table has shape {tuple(table.shape)}; expected {r} rows and at least "
            f"{blocks_per_seq} columns for max_seq_len={max_seq}, block_size={block_size}"
        )
    ids = table[:, :blocks_per_seq].to(torch.int64)
    used = np.arange(blocks_per_seq)[None, :] < (-(-seq_lens // block_size))[:, None]
    if not used.all():
        ids = ids * dev(used)  # stale entries past a row's blocks -> block 0, masked out below
    md.gather_block_ids = ids.reshape(-1)
    kv_len = blocks_per_seq * block_size
    if max_q <= SMALL_QUERY_LEN and write_index is None:
        md.rows = StepRows(tuple(step.req_ids), tuple(computed.tolist()), tuple(seq_lens.tolist()))
        if kind == DECODE:
            md.token_kv_lens = md.seq_lens
        else:
            starts = np.repeat(qsl[:-1], n)
            md.token_rows = dev(np.repeat(np.arange(r), n))
            md.token_kv_lens = dev(np.repeat(computed, n) + np.arange(t) - starts + 1)
    if r == 1:
        md.single_kv_len = kv_len = int(seq_lens[0])
        if kind == DECODE:
            md.kv_len = kv_len
            return md
    md.kv_len = kv_len
    limit = np.minimum(computed[:, None] + cols[None, :], seq_lens[:, None] - 1)  # [R, Lq]
    if kind == DECODE and (limit == kv_len - 1).all():
        return md
    md.attn_mask = dev(np.arange(kv_len)[None, None, None, :] <= limit[:, None, :, None])
    return md


@dataclass
class ForwardContext:
    """What the attention function needs besides its q/k/v: the step and the caches."""

    metadata: AttentionMetadata
    kv_caches: Sequence[torch.Tensor]


_context: ForwardContext | None = None


@contextmanager
def attention_context(metadata: AttentionMetadata, kv_caches: Sequence[torch.Tensor]) -> Iterator[ForwardContext]:
    """Make ``metadata`` and ``kv_caches`` visible to :func:`paged_attention_forward`.

    A module global rather than a forward kwarg: HF passes unknown kwargs
    through most models, but not all, and a global costs nothing per layer.
    """
    global _context
    previous = _context
    _context = ForwardContext(metadata, kv_caches)
    try:
        yield _context
    finally:
        _context = previous


def get_attention_context() -> ForwardContext | None:
    return _context


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """HF attention-interface function: ``[1, H, T, D]`` q and ``[1, Hkv, T, D]`` k/v in,
    ``[1, T, H, D]`` out.

    Writes this step's keys/values into the layer's paged cache, then lets
    each sequence's queries attend to its own context. HF's
    ``attention_mask`` is ``None`` here (no mask function is registered for
    ``ATTN_IMPL``); causality comes from the step metadata.
    """
    ctx = _context
    if ctx is None:
        raise RuntimeError(
            f"attention implementation {ATTN_IMPL!r} was called outside omnistage's attention_context(); "
            "run the model through omnistage.models.adapter.CausalLM.forward"
        )
    cache = ctx.kv_caches[module.layer_idx]
    out = paged_attention(query[0], key[0], value[0], cache, ctx.metadata, scaling)
    return out[None], None


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cache: torch.Tensor,
    md: AttentionMetadata,
    scaling: float | None,
) -> torch.Tensor:
    """One layer's paged attention on packed tokens, heads first.

    ``query`` ``[H, T, D]`` and ``key``/``value`` ``[Hkv, T, D]`` (views are
    fine, e.g. a transposed ``[T, H, D]``; RoPE already applied) in,
    ``[T, H, D]`` out. Writes this step's keys/values into ``cache`` first.
    Used by the HF attention-interface function and by the lean forward
    (:mod:`omnistage.models.fast_forward`).
    """
    kind = md.kind
    appended = _store_continuing(cache, key, value, md)
    if not appended:
        write_kv(cache, key, value, md.write_slots, md.write_token_index)
    if md.rows is None:
        invalidate_dense_view(cache)
    if kind == DECODE or kind == MIXED:
        return _attend_cache(query, cache, md, scaling, key, value, appended)
    gqa = query.shape[0] != key.shape[0]
    if kind == PREFILL_SINGLE:
        # One fresh sequence: the packed batch already is its causal layout.
        out = F.scaled_dot_product_attention(
            query[None], key[None], value[None], is_causal=True, scale=scaling, enable_gqa=gqa
        )
        return out[0].transpose(0, 1)
    # Several fresh sequences: nothing to read from the cache, pad this step's q/k/v per sequence.
    q, k, v = _pad(query, md), _pad(key, md), _pad(value, md)
    mask = md.attn_mask
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scaling, enable_gqa=gqa)
    out = out.transpose(1, 2).reshape(-1, out.shape[1], out.shape[3])  # [R * Lq, H, D]
    if md.output_index is not None:
        out = out.index_select(0, md.output_index)
    return out


def _pad(x: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
    """Packed ``[heads, T, D]`` -> padded ``[R, heads, Lq, D]``."""
    if md.query_index is not None:
        x = x.index_select(1, md.query_index)
    return x.reshape(x.shape[0], md.num_reqs, md.max_query_len, x.shape[2]).transpose(0, 1)


def _continues_view(view: DenseDecodeView, md: AttentionMetadata) -> bool:
    """Whether this step can read its context from ``view`` (the previous step's)."""
    return (
        view.valid and md.rows is not None and md.rows.follows(view.key) and view.keys.shape[1] == md.num_reqs
        and view.keys.shape[2] >= md.kv_len
    )  # fmt: skip


def _stores_natively(md: AttentionMetadata) -> bool:
    """Whether this step's keys/values can go to the paged cache and a dense view in one native
    store: a step of few tokens per row, every token written, and the kernels built."""
    return md.rows is not None and native_kernels() is not None


@dataclass
class ContinuedViews:
    """Every layer's dense view for a step that continues them, and where its tokens go there."""

    views: list[DenseDecodeView]
    index: torch.Tensor  # [T] each new token's column in a view flattened to [Hkv, rows * capacity, D]
    token_rows: torch.Tensor | None  # [T] each token's view row (None: token t is row t)
    key: StepRows  # what the views hold once the step has run


def continuing_decode_views(kv_caches: Sequence[torch.Tensor], md: AttentionMetadata) -> ContinuedViews | None:
    """For a decode or verify step that every layer can run on the native kernels in one call
    (``kernels/decode_layers.py``): each layer's dense view, when all of them continue the
    previous step's with one capacity; else ``None``, and the step runs layer by layer. The
    caller writes and reads the views as :func:`paged_attention` would, then calls
    :func:`continued_decode_views`.

    A step whose requests are some of the views' (the others finished or were preempted)
    continues too, each request in its own view row; the rows of those that left stay
    unread until the next batch rebuilds the views. Without that each request leaving the
    batch cost two steps of whole-context gathers (about 10 ms each at batch 6 here).
    """
    if not _stores_natively(md):
        return None
    views = [dense_view(cache) for cache in kv_caches]
    key = views[0].key
    capacity = views[0].keys.shape[2] if views[0].keys is not None else -1
    if all(_continues_view(view, md) and view.keys.shape[2] == capacity for view in views):
        return ContinuedViews(views, md.dense_index(capacity), md.token_rows, md.rows)
    if capacity < md.kv_len or not all(v.valid and v.key is key and v.keys.shape[2] == capacity for v in views):
        return None
    rows = md.rows.rows_in(key)
    if rows is None:
        return None
    view_rows = torch.from_numpy(rows).to(md.seq_lens.device)
    token_rows = view_rows if md.token_rows is None else view_rows[md.token_rows]
    return ContinuedViews(views, token_rows * capacity + md.token_kv_lens - 1, token_rows, key.advanced(rows, md.rows))


def continued_decode_views(continued: ContinuedViews) -> None:
    """The views now hold the step's keys/values (what :func:`_decode_context` records)."""
    for view in continued.views:
        view.key = continued.key


def _store_continuing(cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, md: AttentionMetadata) -> bool:
    """For a step that continues the layer's dense view: this step's keys/values into the paged
    cache and the view in one native call. ``False`` (nothing written) otherwise."""
    if not _stores_natively(md):
        return False
    view = dense_view(cache)
    if not _continues_view(view, md):
        return False
    index = md.dense_index(view.keys.shape[2])
    return native_kv_store(key, value, cache, md.write_slots, (view.keys, view.values, index))


def _decode_context(
    cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, md: AttentionMetadata, appended: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys/values ``[Hkv, R, kv_len, D]`` of a ``rows`` step, from the layer's dense view when
    this step continues the previous one (appending ``key``/``value``, this step's
    ``[Hkv, T, D]``, unless ``appended`` says that is done), else gathered from the blocks
    (and a view built for the next steps)."""
    view = dense_view(cache)
    r, kv_len = md.num_reqs, md.kv_len
    if _continues_view(view, md):
        if not appended:
            capacity = view.keys.shape[2]
            heads, dim = view.keys.shape[0], view.keys.shape[3]
            index = md.dense_index(capacity)
            view.keys.view(heads, r * capacity, dim).index_copy_(1, index, key)
            view.values.view(heads, r * capacity, dim).index_copy_(1, index, value)
        k, v = view.keys[:, :, :kv_len], view.values[:, :, :kv_len]
    else:
        k, v = gather_kv(cache, md.flat_gather_ids(cache.shape[1], cache.shape[2]), r)
        k, v = k[:, :, :kv_len], v[:, :, :kv_len]
        if md.rows.follows(view.key):
            # The second step of the same batch in a row: later ones will likely follow.
            build_dense_view(view, cache, k, v, md.block_size)
        else:
            view.valid = False
    view.key = md.rows
    return k, v


def _attend_cache(
    query: torch.Tensor,
    cache: torch.Tensor,
    md: AttentionMetadata,
    scaling: float | None,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    appended: bool = False,
) -> torch.Tensor:
    """Queries ``[H, T, D]`` over each sequence's cached blocks (decode, chunked prefill, prefix hits).

    Grouped-query attention without repeating K/V: the ``group`` query heads
    that share a KV head become that KV head's query rows, so q is
    ``[Hkv, R, group * Lq, D]`` against K/V ``[Hkv, R, Lk, D]`` straight from
    :func:`gather_kv` (or, for a decode step that continues the previous one,
    from the layer's dense view; ``key``/``value`` are then this step's new
    ``[Hkv, T, D]``, appended to it). HF orders heads so that query head
    ``h`` reads KV head ``h // group``, which is what viewing ``H`` as
    ``(Hkv, group)`` gives.
    """
    num_heads, num_tokens, head_dim = query.shape
    num_kv_heads = cache.shape[1]
    group = num_heads // num_kv_heads
    r, lq = md.num_reqs, md.max_query_len
    if md.rows is not None and key is not None:
        k, v = _decode_context(cache, key, value, md, appended)
    else:
        k, v = gather_kv(cache, md.flat_gather_ids(num_kv_heads, cache.shape[2]), r)
        if md.single_kv_len is not None:
            k, v = k[:, :, : md.single_kv_len], v[:, :, : md.single_kv_len]
    scale = head_dim**-0.5 if scaling is None else scaling
    if md.token_kv_lens is not None:
        # One pass per (KV head, token) over its own sequence's keys up to its position, no mask
        # (fp32 CPU, where built).
        out = native_decode_attention(query, k, v, md.token_kv_lens, scale, md.token_rows)
        if out is not None:
            return out
    q = query.view(num_kv_heads, group, num_tokens, head_dim)  # [Hkv, G, T, D]
    if md.query_index is not None:
        q = q.index_select(2, md.query_index)
    # [Hkv, G, R, Lq, D] -> [Hkv, R, G * Lq, D]; for decode (Lq == 1) this is a small copy of q only.
    q = q.reshape(num_kv_heads, group, r, lq, head_dim).transpose(1, 2).reshape(num_kv_heads, r, group * lq, head_dim)
    if lq <= SMALL_QUERY_LEN and q.dtype == torch.float32:
        # Decode, and the few queries per sequence of a speculative verify step: a handful
        # of query rows. Two batched matmuls and a softmax beat the flash kernel (built for
        # long query blocks) by ~1.5x at lq 1 and several-fold at lq 2-9 with a mask.
        # (Reduced precision keeps SDPA, which accumulates the softmax in fp32.)
        scores = torch.matmul(q, k.transpose(-1, -2))
        scores.mul_(scale)
        bias = md.decode_bias(scores.dtype) if lq == 1 else md.grouped_bias(group, scores.dtype)
        if bias is not None:
            scores.add_(bias)
        out = torch.matmul(scores.softmax(-1), v)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=md.grouped_mask(group), scale=scaling)
    # [Hkv, R, G * Lq, D] -> [R, Lq, Hkv, G, D] -> packed [T, H, D]
    out = out.view(num_kv_heads, r, group, lq, head_dim).permute(1, 3, 0, 2, 4).reshape(r * lq, num_heads, head_dim)
    if md.output_index is not None:
        out = out.index_select(0, md.output_index)
    return out


AttentionInterface.register(ATTN_IMPL, paged_attention_forward)
