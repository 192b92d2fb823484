"""Driving an ``OmniTensorPrefixCache`` from a runner's steps."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from omnistage.core.sched_output import SchedulerOutput
from omnistage.worker.input_batch import BatchStep, InputBatch
from omnistage.models.interface import TensorCachePolicy
from omnistage.worker.tensor_prefix_cache.cache import OmniTensorPrefixCache

__all__ = ["StepTensorCache"]


class StepTensorCache:
    """A stage runner's tensor prefix cache, fed from the scheduler's decisions.

    Policy (on top of ``OmniTensorPrefixCache``'s):

    - **Sized from the KV pool.** One row per KV slot (``num_kv_blocks *
      block_size``), ``hidden_size`` wide (one column for a stage whose
      policy caches no hidden states), in the model's dtype. A KV block and
      its rows share one block id, so they are evicted and reused together.
    - **Written for every forwarded token, every step**, whichever request it
      belongs to: any full block can later be hit by a request that needs rows.
    - **A hit is a new request with ``num_computed_tokens > 0``**, on its first
      step only. That includes a request resumed after preemption, which the
      runner re-adds as new. Its cached rows are its hit blocks, which are always
      full blocks. The KV cache registers a block only after its tokens were
      forwarded, and this cache wrote those rows in that same step. So every row
      a hit reads was written, and the merge checks that.
    - **Blocks newly given to a request that are not hits are invalidated** before
      the step writes. A row left over from a block's previous contents can then
      never be served.
    - **Deferred keys** are staged each step with the rows' token positions. They
      are committed when the request finishes, before its batch row is dropped,
      and discarded when it is aborted or preempted.
    """

    def __init__(
        self, policy: TensorCachePolicy, num_blocks: int, block_size: int, hidden_size: int, dtype: torch.dtype
    ) -> None:
        if not policy.caches_anything:
            raise ValueError("StepTensorCache: the policy caches nothing; build no cache for such a model")
        self.policy = policy
        self.block_size = block_size
        # A stage that hands no hidden states on (a talker: deferred codes only) never writes
        # the hidden rows; the cache's layout has them, one column wide then, not hidden_size.
        width = hidden_size if policy.full_prefix_hidden else 1
        self.cache = OmniTensorPrefixCache(num_blocks, block_size, width, dtype)
        self._hits: dict[str, int] = {}  # this step's hit requests -> cached rows they get
        self.num_hit_requests = 0  # merged hits, and the rows they took from the cache
        self.num_hit_rows = 0

    @property
    def nbytes(self) -> int:
        """Host memory held: every cached key's rows plus their validity flags."""
        c = self.cache
        tensors = [c.hidden_states_cache, *c.mm_outputs_cache.values()]
        flags = c.num_slots * (1 + len(c.mm_outputs_cache))
        return sum(t.numel() * t.element_size() for t in tensors) + flags

    @property
    def num_staged_requests(self) -> int:
        return self.cache.num_staged_requests

    # ---- around the runner's batch update ----------------------------------------

    def begin_step(self, so: SchedulerOutput, input_batch: InputBatch) -> None:
        """Before the batch drops rows: forget last step's hits, commit the deferred
        rows of finished requests (they still need their block-table rows), and drop
        those of aborted and preempted ones."""
        self.cache.reset_prefix_cached_new_req_ids()
        self._hits.clear()
        if self.policy.deferred_keys:
            self.cache.commit_deferred_mm_outputs(so.finished_req_ids, input_batch)
            for req_id in so.aborted_req_ids | so.preempted_req_ids:
                self.cache.discard_deferred_mm_outputs(req_id)

    def rows_added(self, so: SchedulerOutput, fresh_blocks: list[int]) -> None:
        """After the batch took the step's new blocks: mark hits, invalidate the rest
        (``fresh_blocks``: ``so.fresh_block_ids``, which the runner has computed already)."""
        for new in so.scheduled_new_reqs:
            if new.num_computed_tokens > 0:
                self.cache.add_prefix_cached_new_req_id(new.req_id)
                self._hits[new.req_id] = new.num_computed_tokens // self.block_size * self.block_size
        if fresh_blocks:
            self.cache.invalidate_blocks(fresh_blocks)

    def discard(self, req_ids: Iterable[str]) -> None:
        """Drop staged rows of requests that ended outside the step loop (aborts)."""
        for req_id in req_ids:
            self.cache.discard_deferred_mm_outputs(req_id)

    # ---- per step ------------------------------------------------------------

    def write(self, step: BatchStep, states: torch.Tensor | None) -> None:
        """Store the step's per-token tensor at its tokens' KV slots."""
        if self.policy.full_prefix_hidden and states is not None:
            self.cache.update_omni_tensor_prefix_cache(states, None, step.num_tokens, step.slot_mapping)

    def merge(
        self, step: BatchStep, input_batch: InputBatch, states: torch.Tensor, positions: Sequence[int]
    ) -> dict[str, torch.Tensor]:
        """Rows of the step requests at ``positions`` (indices into ``step.req_ids``):
        cached prefix then this step's rows for a hit, this step's rows (a view) otherwise."""
        if not self._hits or not any(step.req_ids[i] in self._hits for i in positions):
            # No hit among them (every step after a request's first): the cache has
            # nothing to add, so skip its bookkeeping and just split the step's rows.
            parts = torch.split_with_sizes(states[: step.num_tokens], step.num_scheduled_tokens.tolist())
            return {step.req_ids[i]: parts[i] for i in positions}
        view = _StepBatch(step, input_batch, positions, step.num_computed_tokens)
        num_sched = dict(zip(view.req_ids, step.num_scheduled_tokens[list(positions)].tolist()))
        merged = self.cache.get_merged_hidden_states(step.query_start_loc, view, states, num_sched)
        for req_id in self._hits.keys() & merged.keys():
            self.num_hit_requests += 1
            self.num_hit_rows += self._hits[req_id]
        return merged

    def stage_deferred(self, step: BatchStep, input_batch: InputBatch, outputs: Mapping[str, Any]) -> None:
        """Stage this step's rows of the deferred keys in ``outputs`` (token aligned)."""
        if not self.policy.deferred_keys:
            return
        # The cache's staging reads a request's first token position as
        # num_computed - num_scheduled: it wants the count *after* this step.
        view = _StepBatch(step, input_batch, range(len(step.req_ids)), step.seq_lens)
        num_sched = dict(zip(step.req_ids, step.num_scheduled_tokens.tolist()))
        self.cache.stage_deferred_mm_outputs(
            step.query_start_loc, view, outputs, num_sched, set(self.policy.deferred_keys)
        )


class _StepBatch:
    """The step's scheduled requests seen as a batch whose row ``i`` is step request ``i``.

    The cache's merge and staging index ``query_start_loc``, the computed-token
    counts and the block tables by one batch row. ``BatchStep.query_start_loc``
    counts only scheduled requests, while the persistent batch also holds
    requests that are not scheduled this step. Re-indexing everything by step
    position makes the three agree. ``req_ids`` may be a subset of the step (the
    requests whose rows are wanted).
    """

    def __init__(
        self, step: BatchStep, input_batch: InputBatch, positions: Iterable[int], num_computed: np.ndarray
    ) -> None:
        self.req_ids = [step.req_ids[i] for i in positions]
        self.req_id_to_index = {step.req_ids[i]: i for i in positions} if self.req_ids else {}
        self.num_computed_tokens_cpu = num_computed
        self.block_table = _StepBlockTables(input_batch, step.rows)


class _StepBlockTables:
    """Block tables of the step's rows, gathered only if a hit reads them."""

    def __init__(self, input_batch: InputBatch, rows: np.ndarray) -> None:
        self._tables = input_batch.block_table.block_tables
        self._rows = rows
        self._groups: list[_StepBlockTable] | None = None

    @property
    def block_tables(self) -> list[_StepBlockTable]:
        if self._groups is None:
            self._groups = [_StepBlockTable(t.block_table.cpu, t.num_blocks_per_row, self._rows) for t in self._tables]
        return self._groups

    def __getitem__(self, group: int) -> _StepBlockTable:
        return self.block_tables[group]


class _StepBlockTable:
    def __init__(self, table: torch.Tensor, num_blocks_per_row: np.ndarray, rows: np.ndarray) -> None:
        self.block_table = _Cpu(table.index_select(0, torch.from_numpy(rows)))
        self.num_blocks_per_row = num_blocks_per_row[rows]


class _Cpu:
    def __init__(self, cpu: torch.Tensor) -> None:
        self.cpu = cpu
