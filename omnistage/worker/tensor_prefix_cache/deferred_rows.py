"""Rows of deferred cache keys, staged per request until the request finishes.

Some per-token outputs (e.g. audio codes) are only worth caching for later hits,
so they are not written every step: each step's rows are staged here per
request, and the tensor prefix cache writes them once when the request finishes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from omnistage.worker.tensor_prefix_cache.payload import int_list

# One staged chunk: (token position of its first row, its rows).
DeferredChunk = tuple[int, torch.Tensor]


class DeferredRows:
    """Staged chunks by request id, then by key, in staging order."""

    def __init__(self) -> None:
        self.staged: dict[str, dict[str, list[DeferredChunk]]] = {}

    def stage(
        self,
        query_start_loc: Any,
        input_batch: Any,
        outputs: Mapping[str, Any],
        num_scheduled_tokens: Mapping[str, int],
        keys: set[str],
    ) -> None:
        """Stage each request's rows of ``keys`` (tensors of ndim >= 2; others are ignored).

        ``num_computed_tokens_cpu`` already counts this step's tokens, so a request's
        ``n`` rows start at token position ``num_computed - n``.
        """
        qsl = int_list(query_start_loc)
        index, computed = input_batch.req_id_to_index, input_batch.num_computed_tokens_cpu
        for key in keys:
            value = outputs.get(key)
            if not isinstance(value, torch.Tensor) or value.ndim < 2:
                continue
            for req_id in input_batch.req_ids:
                n = int(num_scheduled_tokens.get(req_id, 0))
                if n <= 0:
                    continue
                start = qsl[index[req_id]]
                end = min(start + n, value.shape[0])
                if end <= start:
                    continue
                token_start = max(0, int(computed[index[req_id]]) - n)
                # A copy, not a view: the step's output may be a reused buffer, and a view
                # would keep the whole batch tensor alive until the request finishes.
                chunk = value[start:end].detach().clone()
                self.staged.setdefault(req_id, {}).setdefault(key, []).append((token_start, chunk))


def assemble(chunks: list[DeferredChunk]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """All rows of one key's chunks and the token position of each (CPU int64).

    Where chunks overlap, the chunk with the later start wins (at equal starts, the
    one staged later), each position appearing once. None when there are no rows.
    """
    chunks = sorted((c for c in chunks if c[1].shape[0] > 0), key=lambda c: c[0])  # stable
    if not chunks:
        return None
    rows = torch.cat([t for _, t in chunks]) if len(chunks) > 1 else chunks[0][1]
    lengths = torch.tensor([t.shape[0] for _, t in chunks])
    starts = torch.tensor([s for s, _ in chunks])
    # Every row's position without a loop per chunk: its chunk's start + its offset in the chunk.
    positions = torch.arange(rows.shape[0]) + torch.repeat_interleave(starts - (lengths.cumsum(0) - lengths), lengths)
    if positions.numel() < 2 or bool((positions[1:] > positions[:-1]).all()):
        return rows, positions
    # Overlap: index_copy_ leaves the winner of a repeated index undefined, so keep the last only.
    order = torch.arange(positions.numel())
    last = torch.full((int(positions.max()) + 1,), -1, dtype=torch.long)
    last.scatter_reduce_(0, positions, order, reduce="amax")
    keep = (last.index_select(0, positions) == order).nonzero().squeeze(1)
    return rows.index_select(0, keep.to(rows.device)), positions.index_select(0, keep)
