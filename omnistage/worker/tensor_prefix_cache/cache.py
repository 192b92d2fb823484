"""Per-token hidden states and multimodal outputs cached beside the KV blocks."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import torch

from omnistage.worker.tensor_prefix_cache.deferred_rows import DeferredChunk, DeferredRows, assemble
from omnistage.worker.tensor_prefix_cache.payload import RequestSpans, divide_among_requests, to_cpu_tree

logger = logging.getLogger(__name__)

PAD_SLOT_ID = -1
HIDDEN_KEY = "hidden_states"  # how the hidden-state cache is named in errors


class _Rows(NamedTuple):
    """One cached key: its rows, which of them are valid, and the views writes go through."""

    name: str
    data: torch.Tensor  # [num_blocks, block_size, *trailing]
    valid: torch.Tensor  # [num_blocks, block_size] bool
    flat: torch.Tensor  # data as [num_slots, *trailing]
    wide: torch.Tensor | None  # data as [num_slots, k] 16-byte elements, when rows allow it


class OmniTensorPrefixCache:
    """Block-paged CPU cache of per-token tensors, mirroring the KV cache layout.

    Keying: row ``block_id * block_size + offset`` of each cache holds the tensor of
    the token whose KV sits in that slot, so a KV prefix hit (a list of block ids)
    addresses its cached rows directly. One cache holds the final hidden states;
    one more per multimodal key, registered the first time a step emits a tensor
    for it with one row per token (ndim >= 2, any trailing shape). Keys are never
    unregistered and nothing is evicted: a reused block is rewritten. Caches live
    on CPU (pinned when CUDA is available); inputs may be on any device.

    Validity: each key has a flag per slot, set when the slot is written (a step's
    update or a deferred commit) and cleared by ``invalidate_blocks``, which the
    runner calls for blocks newly given to a request that are not prefix hits,
    i.e. whose contents change.

    A hit (a request marked with ``add_prefix_cached_new_req_id`` this step) is
    served from its full computed blocks, and every row served was written for the
    block's current contents: otherwise the merge raises RuntimeError naming the
    request and the key, rather than return zeros or stale rows. Misses get views
    of this step's rows, without a copy.

    Deferred keys (e.g. audio codes) are staged per request and written when the
    request finishes, only into block-table entries allocated to it.
    """

    def __init__(self, num_blocks: int, block_size: int, hidden_size: int, hs_dtype: torch.dtype) -> None:
        if num_blocks <= 0 or block_size <= 0 or hidden_size <= 0:
            raise ValueError(
                "expected positive num_blocks, block_size and hidden_size, "
                f"got {num_blocks}, {block_size} and {hidden_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_slots = num_blocks * block_size
        self.default_hidden_size = hidden_size
        # Pinned host memory only helps (and only works) with a CUDA device to copy from.
        self._pin_memory = torch.cuda.is_available()
        self._hidden = self._allocate(HIDDEN_KEY, (hidden_size,), hs_dtype)
        self.hidden_states_cache = self._hidden.data
        self._mm: dict[str, _Rows] = {}
        self.mm_outputs_cache: dict[str, torch.Tensor] = {}
        self.mm_cache_keys: set[str] = set()
        self._new_req_cache_hit_ids: set[str] = set()
        self._deferred = DeferredRows()
        self._warned_multi_group = False

    # ---- registration and invalidation -----------------------------------------------

    def maybe_init_missing_mm_cache_keys(self, multimodal_outputs: Mapping[str, Any] | None, seq_len: int) -> None:
        """Register each top-level tensor of ``seq_len`` rows and ndim >= 2 not cached yet.

        1-D tensors are per-request metadata, not per-token features: they stay passthrough.
        """
        for key, value in (multimodal_outputs or {}).items():
            if key not in self._mm and isinstance(value, torch.Tensor) and value.ndim >= 2:
                if value.shape[0] == seq_len:
                    self._register_mm_key(key, value)

    def invalidate_blocks(self, block_ids: torch.Tensor | Iterable[int]) -> None:
        """Forget every cached row of these blocks: their contents are about to change."""
        ids = torch.as_tensor(block_ids if isinstance(block_ids, torch.Tensor) else list(block_ids))
        ids = ids.reshape(-1).to(device="cpu", dtype=torch.long)
        if ids.numel():
            self._check_block_ids(ids, "invalidate_blocks")
            for rows in (self._hidden, *self._mm.values()):
                rows.valid.index_fill_(0, ids, False)

    # ---- step writes ---------------------------------------------------------------

    def update_omni_tensor_prefix_cache(
        self,
        hidden_states: torch.Tensor | None,
        multimodal_outputs: Mapping[str, Any] | None,
        num_tokens_unpadded: int,
        slot_mapping: torch.Tensor,
        num_tokens_padded: int | None = None,
        skip_mm_cache_keys: set[str] | None = None,
        hidden_states_cpu: torch.Tensor | None = None,
    ) -> None:
        """Write this step's first ``num_tokens_unpadded`` rows to their slots; slot -1 is skipped."""
        n = num_tokens_unpadded
        if n < 0:
            raise ValueError(f"num_tokens_unpadded: expected >= 0, got {n}")
        slots, keep = self._step_slots(slot_mapping, n)
        writes: list[tuple[_Rows, torch.Tensor]] = []
        if hidden_states is not None:
            writes.append((self._hidden, self._resolve_hidden_states_cpu(hidden_states, n, hidden_states_cpu)))
        if multimodal_outputs:
            seq_len = n if num_tokens_padded is None else num_tokens_padded
            self.maybe_init_missing_mm_cache_keys(multimodal_outputs, seq_len)
            skip = skip_mm_cache_keys or ()
            for key, rows in self._mm.items():
                value = multimodal_outputs.get(key)
                if value is not None and key not in skip:
                    writes.append((rows, _leading_rows(key, value, n)))
        # Check every source before writing any, so bad input never leaves a half-written step.
        for rows, src in writes:
            _check_matches(rows, src)
        for rows, src in writes:
            self._write(rows, slots, src if keep is None else src.index_select(0, keep.to(src.device)))

    def _step_slots(self, slot_mapping: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """CPU int64 slots of the first ``n`` tokens minus padding, and the rows kept if any was dropped."""
        if not isinstance(slot_mapping, torch.Tensor):
            slot_mapping = torch.as_tensor(slot_mapping)
        bad_dtype = slot_mapping.is_floating_point() or slot_mapping.dtype == torch.bool
        if slot_mapping.ndim != 1 or slot_mapping.shape[0] < n or bad_dtype:
            raise ValueError(
                f"slot_mapping: expected a 1-D integer tensor of at least {n} slots, "
                f"got {slot_mapping.dtype} of shape {tuple(slot_mapping.shape)}"
            )
        slots = slot_mapping if slot_mapping.shape[0] == n else slot_mapping[:n]
        if slots.device.type != "cpu" or slots.dtype != torch.long:
            slots = slots.to(device="cpu", dtype=torch.long)
        if n == 0:
            return slots, None
        lo, hi = torch.aminmax(slots)
        lo, hi = int(lo), int(hi)
        if lo < PAD_SLOT_ID or hi >= self.num_slots:
            bad = lo if lo < PAD_SLOT_ID else hi
            raise ValueError(f"slot_mapping: expected slots in [0, {self.num_slots}) or -1 (padding), got {bad}")
        if lo > PAD_SLOT_ID:
            return slots, None
        keep = (slots != PAD_SLOT_ID).nonzero().squeeze(1)
        return slots.index_select(0, keep), keep

    def _write(self, rows: _Rows, slots: torch.Tensor, src: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        if src.device.type != "cpu":
            src = src.to("cpu")
        if src.requires_grad:  # else the in-place copy would pull the cache into autograd
            src = src.detach()
        # index_copy_ costs per element, not per byte: on rows reinterpreted as 16-byte
        # elements it runs at memcpy speed (bit-exact: a copy, not a conversion).
        wide_src = _as_wide_rows(src) if rows.wide is not None else None
        if wide_src is not None:
            rows.wide.index_copy_(0, slots, wide_src)
        else:
            rows.flat.index_copy_(0, slots, src)
        rows.valid.view(-1).index_fill_(0, slots, True)

    # ---- hit bookkeeping -----------------------------------------------------------

    def add_prefix_cached_new_req_id(self, req_id: str) -> None:
        self._new_req_cache_hit_ids.add(req_id)

    def reset_prefix_cached_new_req_ids(self) -> None:
        self._new_req_cache_hit_ids.clear()

    def has_prefix_cached_new_req_ids(self) -> bool:
        return bool(self._new_req_cache_hit_ids)

    # ---- deferred writes -----------------------------------------------------------

    @property
    def num_staged_requests(self) -> int:
        """Requests with deferred outputs staged and not yet committed or discarded."""
        return len(self._deferred_mm_outputs)

    def stage_deferred_mm_outputs(
        self,
        query_start_loc: Any,
        input_batch: Any,
        multimodal_outputs: Mapping[str, Any] | None,
        num_scheduled_tokens: Mapping[str, int],
        deferred_mm_cache_keys: set[str] | None,
    ) -> None:
        """Stage this step's rows of the deferred keys per request, until each finishes."""
        if multimodal_outputs and deferred_mm_cache_keys:
            self._deferred.stage(query_start_loc, input_batch, multimodal_outputs, num_scheduled_tokens,
                                 deferred_mm_cache_keys)

    def commit_deferred_mm_outputs(self, finished_req_ids: Iterable[str], input_batch: Any) -> None:
        """Write the staged rows of finished requests; call before their rows leave the batch."""
        if not finished_req_ids or not self._deferred.staged:
            return
        errors: list[Exception] = []
        for req_id in finished_req_ids:
            staged = self._deferred.staged.pop(req_id, None)
            if staged is None:
                continue
            idx = input_batch.req_id_to_index.get(req_id)
            if idx is None:
                logger.warning("request %r left the batch before its deferred rows were committed", req_id)
                continue
            for key, chunks in staged.items():
                try:
                    self._commit_deferred_key(req_id, idx, input_batch, key, chunks)
                except (ValueError, RuntimeError) as error:  # a bad key must not cost the others their rows
                    errors.append(error)
        if errors:
            raise errors[0]

    def discard_deferred_mm_outputs(self, req_id: str) -> None:
        self._deferred.staged.pop(req_id, None)

    @property
    def _deferred_mm_outputs(self) -> dict[str, dict[str, list[DeferredChunk]]]:
        return self._deferred.staged

    def _commit_deferred_key(
        self, req_id: str, idx: int, input_batch: Any, key: str, chunks: list[DeferredChunk]
    ) -> None:
        assembled = assemble(chunks)
        if assembled is None:
            return
        src, positions = assembled
        slots, inside = self._slots_of_positions(idx, input_batch, positions)
        if inside is not None:
            logger.debug("request %r: %d deferred %r rows lie past its allocated blocks; dropped",
                         req_id, positions.numel() - inside.numel(), key)
            src = src.index_select(0, inside.to(src.device))
        rows = self._mm.get(key) or self._register_mm_key(key, src)
        _check_matches(rows, src)
        self._write(rows, slots, src)

    def _slots_of_positions(
        self, idx: int, input_batch: Any, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Slots of a request's token positions; positions past its allocated blocks are dropped."""
        group = input_batch.block_table[0]
        table_row = group.block_table.cpu[idx]
        blocks = positions // self.block_size
        inside = blocks < _allocated_blocks(group, idx, table_row.shape[0])
        kept = None
        if not bool(inside.all()):
            kept = inside.nonzero().squeeze(1)
            positions, blocks = positions[kept], blocks[kept]
        block_ids = table_row.index_select(0, blocks).to(torch.long)
        self._check_block_ids(block_ids, f"block table row {idx}")
        return block_ids * self.block_size + positions % self.block_size, kept

    # ---- merges ----------------------------------------------------------------------

    def get_merged_hidden_states(
        self,
        query_start_loc: Any,
        input_batch: Any,
        hidden_states: torch.Tensor,
        num_scheduled_tokens: Mapping[str, int],
        hidden_states_cpu: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """Per request: its cached prefix rows then this step's rows on a hit, this step's rows otherwise."""
        spans = RequestSpans.from_step(query_start_loc, input_batch, num_scheduled_tokens)
        src = self._resolve_hidden_states_cpu(hidden_states, spans.end, hidden_states_cpu)
        return self._merge(self._hidden, src, spans, self._hit_block_ids(input_batch))

    def get_merged_multimodal_states(
        self,
        query_start_loc: Any,
        input_batch: Any,
        multimodal_outputs: Mapping[str, Any] | None,
        num_scheduled_tokens: Mapping[str, int],
    ) -> dict[str, dict[str, Any]]:
        """``{key: {req_id: value}}``: cached keys merged like hidden states, the rest passed through."""
        if not multimodal_outputs:
            return {}
        spans = RequestSpans.from_step(query_start_loc, input_batch, num_scheduled_tokens)
        hits = self._hit_block_ids(input_batch)
        merged: dict[str, dict[str, Any]] = {}
        passthrough: dict[str, Any] = {}
        for key, value in multimodal_outputs.items():
            if key not in self._mm:
                passthrough[key] = value
            elif value is not None:
                merged[key] = self._merge(self._mm[key], _leading_rows(key, value, spans.end), spans, hits)
        for key, value in to_cpu_tree(passthrough).items():
            merged[key] = dict(zip(spans.req_ids, divide_among_requests(value, spans)))
        return merged

    def _hit_block_ids(self, input_batch: Any) -> list[tuple[str, torch.Tensor]]:
        """(req_id, cached block ids) of each hit request in the batch, looked up once per merge."""
        if not self._new_req_cache_hit_ids:
            return []
        num_groups = len(input_batch.block_table.block_tables)
        if num_groups > 1 and not self._warned_multi_group:
            logger.warning("tensor prefix cache reads only the first of %d KV-cache groups", num_groups)
            self._warned_multi_group = True
        index = input_batch.req_id_to_index
        hits = []
        for req_id in self._new_req_cache_hit_ids:
            if req_id in index:
                block_ids = self._get_cached_block_ids(index[req_id], input_batch).to(torch.long)
                self._check_block_ids(block_ids, f"cached blocks of request {req_id!r}")
                hits.append((req_id, block_ids))
        return hits

    def _merge(
        self, rows: _Rows, src: torch.Tensor, spans: RequestSpans, hits: list[tuple[str, torch.Tensor]]
    ) -> dict[str, torch.Tensor]:
        _check_matches(rows, src)
        if src.device.type != "cpu" or not src.is_contiguous():
            src = src.detach().to("cpu").contiguous()  # the one device-to-host copy of the step's rows
        elif src.requires_grad:
            src = src.detach()
        merged = dict(zip(spans.req_ids, spans.split(src)))
        for req_id, block_ids in hits:
            merged[req_id] = self._prefix_and_new(rows, block_ids, merged[req_id], req_id)
        return merged

    def _prefix_and_new(self, rows: _Rows, block_ids: torch.Tensor, new: torch.Tensor, req_id: str) -> torch.Tensor:
        """Cached rows of ``block_ids`` then ``new``, each row copied once into one fresh buffer."""
        num_blocks = block_ids.numel()
        if num_blocks == 0:
            return new
        valid = rows.valid.index_select(0, block_ids).all(dim=1)
        if not bool(valid.all()):
            raise RuntimeError(
                f"prefix-cache hit of request {req_id!r}: {rows.name!r} rows of cached blocks "
                f"{block_ids[~valid].tolist()} were not written for the blocks' current contents; "
                "expected every row of a hit block to be valid"
            )
        trailing = rows.data.shape[2:]
        num_cached = num_blocks * self.block_size
        out = torch.empty((num_cached + new.shape[0], *trailing), dtype=rows.data.dtype)
        torch.index_select(rows.data, 0, block_ids, out=out[:num_cached].view(num_blocks, self.block_size, *trailing))
        out[num_cached:].copy_(new)
        return out

    def _get_cached_block_ids(self, req_idx: int, input_batch: Any) -> torch.Tensor:
        """Blocks holding the request's computed prefix: full blocks only, as the KV cache hits."""
        num_computed = int(input_batch.num_computed_tokens_cpu[req_idx])
        num_full = num_computed // self.block_size
        group = input_batch.block_table[0]
        table_row = group.block_table.cpu[req_idx]
        allocated = _allocated_blocks(group, req_idx, table_row.shape[0])
        if num_full > allocated:
            raise RuntimeError(
                f"batch row {req_idx}: {num_computed} computed tokens need {num_full} full blocks, "
                f"but only {allocated} block-table entries are allocated"
            )
        return table_row[:num_full].to(torch.long)

    # ---- validation and allocation -----------------------------------------------------

    @staticmethod
    def _resolve_hidden_states_cpu(
        hidden_states: torch.Tensor, num_tokens: int, hidden_states_cpu: torch.Tensor | None
    ) -> torch.Tensor:
        """The first ``num_tokens`` hidden rows: from the staged CPU copy when one is given
        (which must match ``hidden_states``, else RuntimeError), else from ``hidden_states``."""
        if hidden_states_cpu is None:
            if hidden_states.ndim < 1 or hidden_states.shape[0] < num_tokens:
                shape = tuple(hidden_states.shape)
                raise ValueError(f"hidden_states: expected at least {num_tokens} rows, got shape {shape}")
            return hidden_states[:num_tokens]
        staged = hidden_states_cpu
        if staged.device.type != "cpu":
            raise RuntimeError(f"hidden_states_cpu: expected a CPU tensor, got one on {staged.device}")
        if not staged.is_contiguous():
            raise RuntimeError(f"hidden_states_cpu: expected a contiguous tensor, got strides {staged.stride()}")
        if staged.dtype != hidden_states.dtype:
            raise RuntimeError(f"hidden_states_cpu: expected dtype {hidden_states.dtype}, got {staged.dtype}")
        if staged.shape[1:] != hidden_states.shape[1:]:
            raise RuntimeError(
                f"hidden_states_cpu: expected feature shape {tuple(hidden_states.shape[1:])}, "
                f"got {tuple(staged.shape[1:])}"
            )
        if staged.shape[0] < num_tokens:
            raise RuntimeError(f"hidden_states_cpu: expected at least {num_tokens} rows, got {staged.shape[0]}")
        return staged[:num_tokens]

    def _check_block_ids(self, block_ids: torch.Tensor, what: str) -> None:
        if block_ids.numel():
            lo, hi = int(block_ids.min()), int(block_ids.max())
            if lo < 0 or hi >= self.num_blocks:
                bad = lo if lo < 0 else hi
                raise ValueError(f"{what}: expected block ids in [0, {self.num_blocks}), got {bad}")

    def _register_mm_key(self, key: str, like: torch.Tensor) -> _Rows:
        trailing = tuple(like.shape[1:])
        logger.info("caching multimodal output %r: rows of shape %s, %s", key, trailing, like.dtype)
        rows = self._mm[key] = self._allocate(key, trailing, like.dtype)
        self.mm_outputs_cache[key] = rows.data
        self.mm_cache_keys.add(key)
        return rows

    def _allocate(self, name: str, trailing: tuple[int, ...], dtype: torch.dtype) -> _Rows:
        data = torch.zeros((self.num_blocks, self.block_size, *trailing), dtype=dtype, pin_memory=self._pin_memory)
        valid = torch.zeros((self.num_blocks, self.block_size), dtype=torch.bool)
        flat = data.view(self.num_slots, *trailing)
        return _Rows(name, data, valid, flat, _as_wide_rows(flat))


def _leading_rows(key: str, value: Any, n: int) -> torch.Tensor:
    """The first ``n`` rows of a per-token output."""
    if not isinstance(value, torch.Tensor) or value.ndim < 1 or value.shape[0] < n:
        got = f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{key!r}: expected a per-token tensor of at least {n} rows, got {got}")
    return value[:n]


def _check_matches(rows: _Rows, src: torch.Tensor) -> None:
    if src.dtype != rows.data.dtype or src.shape[1:] != rows.data.shape[2:]:
        raise ValueError(
            f"{rows.name!r}: expected {rows.data.dtype} rows of shape {tuple(rows.data.shape[2:])}, "
            f"got {src.dtype} rows of shape {tuple(src.shape[1:])}"
        )


def _allocated_blocks(group: Any, idx: int, row_width: int) -> int:
    """Entries of block-table row ``idx`` allocated to its request (the whole row if untracked)."""
    counts = getattr(group, "num_blocks_per_row", None)
    return row_width if counts is None else min(int(counts[idx]), row_width)


def _as_wide_rows(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` (rows >= 1) viewed as [rows, k] 16-byte elements; None unless rows are dense 16-byte multiples."""
    row_elems = t.numel() // t.shape[0] if t.ndim >= 2 and t.shape[0] else 0
    es = t.element_size()
    if not row_elems or (row_elems * es) % 16 or (t.storage_offset() * es) % 16 or not t.is_contiguous():
        return None
    return t.view(t.shape[0], row_elems).view(torch.complex128)
