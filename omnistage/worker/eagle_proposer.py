"""The worker's EAGLE drafter: after each target forward, draft the next step's tokens.

Policy:

- **The head's KV follows the target's, lazily.** At position ``q`` the head
  reads the target's final hidden state at ``q`` and the input embedding of
  token ``q + 1`` (for a multimodal target at a placeholder position, the
  encoder row of ``q + 1``: ``gather_mm_embeddings(draft_lookahead=1)``,
  which falls back to the token embedding when the item starting at the
  window's end is not encoded yet); that writes the head's KV at ``q``.
  Only verified tokens go through it (prefill chunks, plain decodes,
  verified drafts; rejected drafts never). A request that samples this step
  without being asked for drafts (``draft_token_requests``: the draft policy
  left it at zero and no probe is due) skips the head pass for its
  generated tokens: their target hidden states are kept instead, in a
  bounded per-request window (``CATCH_UP_WINDOW`` positions, in one pool
  preallocated for ``max_num_seqs`` requests: ``max_num_seqs * 64 * hidden``
  values, 9.4 MB for the embedded default's 64 x 576 fp32; a window is freed
  once caught up, and with its request). The head runs over the kept
  positions and the step's tokens together, in one pass, when the request
  is next asked for drafts (the catch-up, at draft time: the scheduler needs
  to know nothing about it), when the window would overflow, and when the
  request leaves the batch (finished, aborted, preempted: ``release``), so
  no position is ever lost: once a request drafts or leaves, the head's KV
  is exactly what running the head every step would have written, and a
  prefix hit on its blocks reads complete head KV (a hit on the generated
  blocks of a request still running and skipping could read positions whose
  head KV is still owed: only the hitting request's drafts' quality can
  differ, verification keeps its output exact). Prompt positions are
  never kept (a prefill chunk runs the head at once: the encoder rows it may
  read are there only now). A step where no request drafts, catches up or
  fills its window runs no head at all: it costs a speculation-off step
  plus one copy of the kept rows. A pass computes the head's output only
  at the rows drafts are read from (a drafting request's last one): the
  other positions need only their KV, so they skip the layer's output
  projection and MLP (a release pass computes no output at all), which
  makes a catch-up about a third of a full pass per position.
- **Its KV is paged like the target's**: one layer, its own tensors, the
  target's block ids and slots. So it is allocated, shared on a prefix hit,
  and freed with the request's blocks, and needs no block bookkeeping of its own.
  (A prefix hit's last cached position holds the head's KV computed with the
  earlier request's next token: only the drafts' quality can differ.)
- **Drafting**: for the requests the scheduler names
  (``draft_token_requests``), the head's output at the last verified
  position gives draft 1 through the target's LM head (argmax: drafts are
  deterministic, which the rejection sampler assumes), then ``k - 1`` more
  single-token steps feed back the draft and the head's own output. Those
  steps write the head's KV past the verified tokens; the next head pass
  over those positions (that step's, or a catch-up) overwrites it. A
  request stops drafting where its next position has no allocated KV slot
  (the scheduler reserves ``k - 1`` when it can) or reaches
  ``max_model_len``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from omnistage.attention.paged_attention import (
    allocate_kv_caches,
    build_attention_metadata,
)
from omnistage.worker.input_batch import BatchStep, InputBatch

__all__ = ["CATCH_UP_WINDOW", "EagleProposer"]

# Positions of target hidden states kept per request while the head is skipped:
# the draft policy's longest probe gap (core/spec_policy.PROBE_MAX_GAP), so a
# request probed on schedule catches up in one pass without ever overflowing.
CATCH_UP_WINDOW = 64


@dataclass
class _HeadStep:
    """A step of the head (what attention metadata needs): one segment of
    consecutive positions per request."""

    req_ids: list[str]
    num_scheduled_tokens: np.ndarray
    num_computed_tokens: np.ndarray
    seq_lens: np.ndarray
    query_start_loc: np.ndarray
    num_tokens: int
    input_ids: torch.Tensor  # empty: build_attention_metadata reads only its device
    slot_mapping: torch.Tensor
    block_table: torch.Tensor


@dataclass
class _Kept:
    """A request's positions ``[start, start + count)`` whose head pass is owed; their
    target hidden states are rows ``[0, count)`` of pool slot ``slot``."""

    slot: int
    start: int
    count: int = 0


class EagleProposer:
    """An ``EagleHead`` with its paged KV, driven from the model runner's steps."""

    def __init__(
        self,
        head: Any,
        target: Any,
        num_kv_blocks: int,
        block_size: int,
        max_model_len: int,
        device: torch.device,
        max_num_seqs: int,
        window: int = CATCH_UP_WINDOW,
    ) -> None:
        self.head = head
        self.target = target
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = device
        self.kv_caches = allocate_kv_caches(
            1,
            num_kv_blocks,
            block_size,
            head.num_kv_heads,
            head.head_dim,
            head.dtype,
            device,
        )
        self.window = window
        # Kept target hidden states, one window per request that skips the head.
        self._pool = torch.empty(
            (max_num_seqs, window, target.hidden_size),
            dtype=target.dtype,
            device=device,
        )
        # The same rows flat (slot s, row i at s * window + i), made once: _keep writes one every idle step.
        self._pool_rows = self._pool.view(-1, target.hidden_size)
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        self._kept: dict[str, _Kept] = {}
        self._no_ids = torch.empty(0, dtype=torch.int64, device=device)  # a head step's input_ids (see _HeadStep)
        self.num_head_tokens = (
            0  # positions run through the head (catch-ups included), for tests
        )

    @property
    def num_kept_requests(self) -> int:
        """Requests whose head pass is owed (for leak checks: zero once all left)."""
        return len(self._kept)

    @torch.inference_mode()
    def propose(
        self,
        step: BatchStep,
        target_hidden: torch.Tensor,
        batch: InputBatch,
        wanted: Mapping[str, int],
        model_state: Any | None = None,
    ) -> dict[str, list[int]]:
        """Run the head over ``step`` (the verified tokens of a step, with their
        target hidden states ``[step.num_tokens, hidden]``; ``batch`` already
        holds the tokens sampled for it), or keep the rows of requests that skip
        it, and draft for the requests in ``wanted``."""
        sampled = set(step.sampling_req_ids)
        run, skip = [], []
        # Plain ints: this runs every step for every request, numpy scalars cost more than the copy.
        computed, scheduled = step.num_computed_tokens.tolist(), step.num_scheduled_tokens.tolist()
        prompt_lens = step.prefill_lens.tolist()
        for i, r in enumerate(step.req_ids):
            kept = self._kept.get(r)
            if kept is not None and kept.start + kept.count != computed[i]:
                # Not contiguous with this step (cannot happen while the batch and the
                # scheduler agree): the kept rows no longer match, so drop them; their
                # positions' head KV stays stale, which only drafts' quality reads.
                self.discard(r)
                kept = None
            held = kept.count if kept is not None else 0
            skips = (
                not wanted.get(r)
                and r in sampled
                and computed[i] >= prompt_lens[i]
                and held + scheduled[i] <= self.window
            )
            (skip if skips else run).append(i)
        if skip:
            self._keep(step, target_hidden, skip, computed, scheduled)
        if not run:
            return {}
        # The run requests drafts are read from (the head's output at their last row).
        chosen = [
            j
            for j, i in enumerate(run)
            if wanted.get(step.req_ids[i], 0) > 0 and step.req_ids[i] in sampled
        ]
        if len(run) == len(step.req_ids) and not any(
            r in self._kept for r in step.req_ids
        ):
            hidden = self._run_step(step, target_hidden, batch, model_state, chosen)
        else:
            hidden = self._run_segments(step, target_hidden, batch, model_state, run, chosen)
        if not chosen:
            return {}
        idx = [run[j] for j in chosen]
        tokens = self._argmax(hidden)
        req_ids = [step.req_ids[i] for i in idx]
        drafts = {r: [t] for r, t in zip(req_ids, tokens.tolist())}
        rows = step.rows[idx]
        budget = np.array([wanted[r] for r in req_ids], dtype=np.int64)
        # Position of the next head step: the emitted token's (one past the last verified).
        pos = step.seq_lens[idx].astype(np.int64)
        table = batch.block_table[0]
        active = np.arange(len(req_ids))
        for j in range(1, int(budget.max())):
            keep = (
                (budget[active] > j)
                & (pos[active] < self.max_model_len)
                & (
                    pos[active] // self.block_size
                    < table.num_blocks_per_row[rows[active]]
                )
            )
            mask = torch.from_numpy(keep).to(self.device)
            hidden, tokens = hidden[mask], tokens[mask]
            active = active[keep]
            if not len(active):
                break
            p = pos[active]
            dstep = self._head_step(
                [req_ids[a] for a in active],
                rows[active],
                p,
                np.ones(len(active), dtype=np.int64),
                table,
            )
            md = build_attention_metadata(dstep, self.block_size)
            embeds = self.target.embed_input_ids(tokens)
            hidden = self.head(
                embeds, hidden, torch.from_numpy(p).to(self.device), md, self.kv_caches
            )
            self.num_head_tokens += len(active)
            tokens = self._argmax(hidden)
            for a, t in zip(active.tolist(), tokens.tolist()):
                drafts[req_ids[a]].append(t)
            pos[active] += 1
        return drafts

    @torch.inference_mode()
    def release(self, req_ids: Collection[str], batch: InputBatch) -> None:
        """Requests leaving the batch (their rows still in it): run the head over
        their kept positions, so their blocks hold complete head KV for a prefix
        hit or a resume, and free their windows."""
        if not self._kept:
            return
        leaving = [r for r in req_ids if r in self._kept and r in batch.req_id_to_index]
        if leaving:
            rows = np.array([batch.req_id_to_index[r] for r in leaving], dtype=np.int64)
            segs = [self._kept[r] for r in leaving]
            starts = np.array([k.start for k in segs], dtype=np.int64)
            counts = np.array([k.count for k in segs], dtype=np.int64)
            pos, embeds, hidden = self._kept_inputs(segs, rows, batch)
            hstep = self._head_step(leaving, rows, starts, counts, batch.block_table[0])
            md = build_attention_metadata(hstep, self.block_size)
            no_rows = self._rows(np.empty(0))  # only the KV is wanted: no output row
            self.head(embeds, hidden, torch.from_numpy(pos).to(self.device), md, self.kv_caches, no_rows)
            self.num_head_tokens += len(pos)
        for r in req_ids:
            self.discard(r)

    def _keep(
        self, step: BatchStep, target_hidden: torch.Tensor, skip: list[int], computed: list[int], counts: list[int]
    ) -> None:
        """Copy the skipping requests' rows of this step (``counts[i]`` from request ``i``'s
        first; a new window starts at its ``computed[i]``) into their windows: a slice copy for
        one request (its rows are consecutive on both sides: the idle batch-1 step), else one
        gather-scatter for all."""
        starts = step.query_start_loc
        stride = self._pool.shape[1]  # a slot's rows (``window`` may be set lower, never higher)
        segments = []  # (first row in the step, first row in the pool, rows)
        for i in skip:
            r = step.req_ids[i]
            kept = self._kept.get(r)
            if kept is None:
                kept = self._kept[r] = _Kept(self._free_slots.pop(), computed[i])
            segments.append((int(starts[i]), kept.slot * stride + kept.count, counts[i]))
            kept.count += counts[i]
        if len(segments) == 1:
            src, dst, k = segments[0]
            self._pool_rows[dst : dst + k] = target_hidden[src : src + k]
            return
        src = [j for a, _, k in segments for j in range(a, a + k)]
        dst = [j for _, b, k in segments for j in range(b, b + k)]
        rows = target_hidden.index_select(0, torch.tensor(src, device=self.device))
        self._pool_rows.index_copy_(0, torch.tensor(dst, device=self.device), rows)

    def discard(self, req_id: str) -> None:
        """Free ``req_id``'s window without running the head (its owed positions stay stale)."""
        kept = self._kept.pop(req_id, None)
        if kept is not None:
            self._free_slots.append(kept.slot)

    def _run_step(
        self,
        step: BatchStep,
        target_hidden: torch.Tensor,
        batch: InputBatch,
        model_state: Any | None,
        chosen: list[int],
    ) -> torch.Tensor:
        """The head over the whole step (no request skips or catches up): its output
        at the last row of each ``chosen`` request."""
        n = step.num_tokens
        positions = step.positions[:n]
        _, embeds = self._step_inputs(step, batch, model_state)
        md = build_attention_metadata(step, self.block_size)
        out_rows = self._rows(step.query_start_loc[1:][chosen] - 1)
        out = self.head(embeds, target_hidden[:n], positions, md, self.kv_caches, out_rows)
        self.num_head_tokens += n
        return out

    def _run_segments(
        self,
        step: BatchStep,
        target_hidden: torch.Tensor,
        batch: InputBatch,
        model_state: Any | None,
        run: list[int],
        chosen: list[int],
    ) -> torch.Tensor:
        """The head over the ``run`` requests of the step, each one's kept positions
        (its catch-up) before its step tokens, in one pass: its output at the last
        row of each ``chosen`` run request. A kept request catches up here and its
        window is freed."""
        n = step.num_tokens
        step_pos, step_embeds = self._step_inputs(step, batch, model_state)
        qsl = step.query_start_loc
        kept = [self._kept.get(step.req_ids[i]) for i in run]
        counts = np.array([k.count if k else 0 for k in kept], dtype=np.int64)
        # Rows of the head's input, in order: an index into [step rows, kept rows],
        # each run request's kept rows before its step rows.
        order, offset = [], n
        for i, count in zip(run, counts):
            order += [np.arange(offset, offset + count), np.arange(qsl[i], qsl[i + 1])]
            offset += count
        order = np.concatenate(order)
        pos_src, hidden_src, embed_src = step_pos, target_hidden[:n], step_embeds
        if offset > n:
            held = [j for j, k in enumerate(kept) if k is not None]
            kept_pos, kept_embeds, kept_hidden = self._kept_inputs(
                [kept[j] for j in held], step.rows[[run[j] for j in held]], batch
            )
            pos_src = np.concatenate([step_pos, kept_pos])
            hidden_src = torch.cat([hidden_src, kept_hidden])
            embed_src = torch.cat([embed_src, kept_embeds])
        pos = pos_src[order]
        index = torch.from_numpy(order).to(self.device)
        rows = step.rows[run]
        scheduled = step.num_scheduled_tokens[run] + counts
        starts = step.num_computed_tokens[run] - counts
        hstep = self._head_step(
            [step.req_ids[i] for i in run],
            rows,
            starts,
            scheduled,
            batch.block_table[0],
        )
        md = build_attention_metadata(hstep, self.block_size)
        out = self.head(
            embed_src.index_select(0, index),
            hidden_src.index_select(0, index),
            torch.from_numpy(pos).to(self.device),
            md,
            self.kv_caches,
            self._rows(hstep.query_start_loc[1:][chosen] - 1),
        )
        self.num_head_tokens += len(pos)
        for i, k in zip(run, kept):
            if k is not None:
                self.discard(step.req_ids[i])
        return out

    def _rows(self, rows: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64)).to(self.device)

    def _kept_inputs(
        self, kept: list[_Kept], rows: np.ndarray, batch: InputBatch
    ) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
        """Windows' positions (each window's in turn), the head's input embeddings for
        them (each next token's) and the target's hidden rows kept for them."""
        counts = np.array([k.count for k in kept], dtype=np.int64)
        pos = np.concatenate([np.arange(k.start, k.start + k.count) for k in kept])
        next_ids = torch.from_numpy(
            batch.token_ids_cpu[np.repeat(rows, counts), pos + 1]
        ).to(self.device)
        hidden = torch.cat([self._pool[k.slot, : k.count] for k in kept])
        return pos, self.target.embed_input_ids(next_ids), hidden

    def _step_inputs(
        self, step: BatchStep, batch: InputBatch, model_state: Any | None
    ) -> tuple[np.ndarray, torch.Tensor]:
        """The step's positions and the head's input embeddings for them (each next token's)."""
        pos = step.positions[: step.num_tokens].cpu().numpy()
        token_rows = np.repeat(step.rows, step.num_scheduled_tokens)
        next_ids = torch.from_numpy(batch.token_ids_cpu[token_rows, pos + 1]).to(
            self.device
        )
        return pos, self._embed_next(step, next_ids, model_state)

    def _argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        greedy = getattr(self.target, "greedy_token_ids", None)
        if greedy is not None:
            return greedy(hidden)
        return self.target.compute_logits(hidden).argmax(-1)

    def _embed_next(
        self, step: BatchStep, next_ids: torch.Tensor, model_state: Any | None
    ) -> torch.Tensor:
        """Input embeddings of each position's next token; encoder rows one position ahead."""
        if model_state is not None and model_state.encoder_runner is not None:
            rows, mask = model_state.gather_mm_embeddings(step, draft_lookahead=1)
            if rows:
                return model_state.encoder_runner.get_inputs_embeds(
                    next_ids, rows, mask
                )
        return self.target.embed_input_ids(next_ids)

    def _head_step(
        self,
        req_ids: list[str],
        rows: np.ndarray,
        starts: np.ndarray,
        counts: np.ndarray,
        table: Any,
    ) -> _HeadStep:
        """Positions ``[starts[i], starts[i] + counts[i])`` of each request (batch ``rows``)."""
        r = len(req_ids)
        qsl = np.zeros(r + 1, dtype=np.int64)
        np.cumsum(counts, out=qsl[1:])
        seq_lens = starts + counts
        positions = np.repeat(starts - qsl[:-1], counts) + np.arange(int(qsl[-1]))
        slots = table.compute_slot_mapping(np.repeat(rows, counts), positions)
        max_blocks = int(-(-seq_lens.max() // self.block_size))
        block_table = table.block_table.cpu[torch.from_numpy(rows), :max_blocks].to(
            self.device
        )
        return _HeadStep(
            req_ids=req_ids,
            num_scheduled_tokens=np.asarray(counts, dtype=np.int64),
            num_computed_tokens=np.asarray(starts, dtype=np.int64),
            seq_lens=seq_lens,
            query_start_loc=qsl,
            num_tokens=int(qsl[-1]),
            input_ids=self._no_ids,
            slot_mapping=torch.from_numpy(slots).to(self.device),
            block_table=block_table,
        )
