"""The worker's EAGLE drafter: after each target forward, draft the next step's tokens.

Policy:

- **Every verified token goes through the head**, whichever request it
  belongs to (prefill chunks, plain decodes, verified drafts; rejected drafts
  never): at position ``q`` the head reads the target's final hidden state
  at ``q`` and the input embedding of token ``q + 1`` (for a multimodal
  target at a placeholder position, the encoder row of ``q + 1``:
  ``gather_mm_embeddings(draft_lookahead=1)``, which falls back to the token
  embedding when the item starting at the window's end is not encoded yet).
  That writes the head's KV for exactly the positions whose target KV exists.
- **Its KV is paged like the target's**: one layer, its own tensors, the
  target's block ids and slots. So it is allocated, shared on a prefix hit,
  and freed with the request's blocks, and needs no bookkeeping of its own.
  (A prefix hit's last cached position holds the head's KV computed with the
  earlier request's next token: only the drafts' quality can differ.)
- **Drafting**: for the requests the scheduler names
  (``draft_token_requests``), the head's output at the last verified
  position gives draft 1 through the target's LM head (argmax: drafts are
  deterministic, which the rejection sampler assumes), then ``k - 1`` more
  single-token steps feed back the draft and the head's own output. Those
  steps write the head's KV past the verified tokens; the next step's pass
  overwrites it. A request stops drafting where its next position has no
  allocated KV slot (the scheduler reserves ``k - 1`` when it can) or
  reaches ``max_model_len``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from omnistage.attention.paged_attention import (
    allocate_kv_caches,
    build_attention_metadata,
)
from omnistage.worker.input_batch import BatchStep, InputBatch

__all__ = ["EagleProposer"]


@dataclass
class _DraftStep:
    """A single-token-per-request step of the head (what attention metadata needs)."""

    req_ids: list[str]
    num_scheduled_tokens: np.ndarray
    num_computed_tokens: np.ndarray
    seq_lens: np.ndarray
    query_start_loc: np.ndarray
    num_tokens: int
    input_ids: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor


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
        holds the tokens sampled for it) and draft for the requests in ``wanted``."""
        n = step.num_tokens
        positions = step.positions[:n]
        pos_np = positions.cpu().numpy()
        token_rows = np.repeat(step.rows, step.num_scheduled_tokens)
        next_ids = torch.from_numpy(batch.token_ids_cpu[token_rows, pos_np + 1]).to(
            self.device
        )
        embeds = self._embed_next(step, next_ids, model_state)
        md = build_attention_metadata(step, self.block_size)
        out = self.head(embeds, target_hidden[:n], positions, md, self.kv_caches)

        sampled = set(step.sampling_req_ids)
        chosen = [
            i
            for i, r in enumerate(step.req_ids)
            if wanted.get(r, 0) > 0 and r in sampled
        ]
        if not chosen:
            return {}
        last = torch.from_numpy(step.query_start_loc[1:][chosen] - 1).to(self.device)
        hidden = out.index_select(0, last)
        tokens = self._argmax(hidden)
        req_ids = [step.req_ids[i] for i in chosen]
        drafts = {r: [t] for r, t in zip(req_ids, tokens.tolist())}
        rows = step.rows[chosen]
        budget = np.array([wanted[r] for r in req_ids], dtype=np.int64)
        # Position of the next head step: the emitted token's (one past the last verified).
        pos = step.seq_lens[chosen].astype(np.int64)
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
            dstep = self._decode_step(
                [req_ids[a] for a in active], rows[active], p, table, tokens
            )
            md = build_attention_metadata(dstep, self.block_size)
            embeds = self.target.embed_input_ids(tokens)
            hidden = self.head(
                embeds, hidden, torch.from_numpy(p).to(self.device), md, self.kv_caches
            )
            tokens = self._argmax(hidden)
            for a, t in zip(active.tolist(), tokens.tolist()):
                drafts[req_ids[a]].append(t)
            pos[active] += 1
        return drafts

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

    def _decode_step(
        self,
        req_ids: list[str],
        rows: np.ndarray,
        positions: np.ndarray,
        table: Any,
        tokens: torch.Tensor,
    ) -> _DraftStep:
        r = len(req_ids)
        slots = table.compute_slot_mapping(rows, positions)
        seq_lens = positions + 1
        max_blocks = int(-(-seq_lens.max() // self.block_size))
        block_table = table.block_table.cpu[torch.from_numpy(rows), :max_blocks].to(
            self.device
        )
        return _DraftStep(
            req_ids=req_ids,
            num_scheduled_tokens=np.ones(r, dtype=np.int64),
            num_computed_tokens=positions,
            seq_lens=seq_lens,
            query_start_loc=np.arange(r + 1, dtype=np.int64),
            num_tokens=r,
            input_ids=tokens,
            slot_mapping=torch.from_numpy(slots).to(self.device),
            block_table=block_table,
        )
