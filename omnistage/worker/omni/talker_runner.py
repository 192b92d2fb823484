"""The talker stage's runner: codec tokens from per-request thinker rows, on the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from omnistage.core.sched_output import SchedulerOutput
from omnistage.models.qwen2_5_omni_talker import TalkerPrompt
from omnistage.worker.attention import build_attention_metadata
from omnistage.worker.input_batch import BatchStep
from omnistage.worker.model_runner import ModelRunner
from omnistage.worker.runner_output import ModelRunnerOutput

__all__ = ["TalkerSequence", "TalkerStageRunner"]


@dataclass
class TalkerSequence:
    """What the runner needs of one talker request besides its token ids.

    ``prompt`` holds the prefill rows, the reply rows and the positions, all of
    the thinker's width (``TalkerPrompt``). ``repetition_penalty`` and
    ``suppress_token_ids`` are the two talker sampling rules that
    ``SamplingParams`` lacks.
    """

    prompt: TalkerPrompt
    repetition_penalty: float = 1.0
    suppress_token_ids: tuple[int, ...] = ()


class TalkerStageRunner(ModelRunner):
    """A ModelRunner whose inputs are embeddings built per request, not token ids.

    A request's token at index ``i`` enters as follows:

    - ``i < P + 2`` (its prompt): ``prompt.prefill_embeds[i]`` at
      ``prompt.positions[:, i]``;
    - ``i >= P + 2``: ``codec_embed(token i) + reply[min(i - P - 2, R - 1)]`` at
      ``i + rope_delta`` on all three axes. Token ``i`` is the code sampled at
      ``i - 1``.

    Both branches are taken per request, so chunked prefill and mixed
    prefill/decode steps work as for text. Before sampling, the logits get
    transformers' repetition penalty, over the talker prompt's codec ids plus
    the codes so far, and ``-inf`` on suppressed ids. The set of ids seen so
    far is kept per request in a ``[max_num_seqs, vocab]`` mask (one gather and
    one scatter per step).
    """

    def __init__(self, loaded_model: Any, block_size: int, num_kv_blocks: int, max_num_seqs: int,
                 *args: Any, **kwargs: Any) -> None:  # fmt: skip
        super().__init__(loaded_model, block_size, num_kv_blocks, max_num_seqs, *args, **kwargs)
        vocab = self.model.vocab_size
        self._seqs: dict[str, TalkerSequence] = {}
        # Slots of the seen-id mask belong to requests in the batch (rows move; slots do not).
        self._slot: dict[str, int] = {}
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        self._seen = torch.zeros(max_num_seqs, vocab, dtype=torch.bool, device=self.device)
        self._suppress = torch.zeros(max_num_seqs, vocab, dtype=torch.bool, device=self.device)
        self._penalty = np.ones(max_num_seqs, dtype=np.float32)

    # -- what the stage asks -----------------------------------------------------

    def add_sequence(self, req_id: str, seq: TalkerSequence) -> None:
        self._seqs[req_id] = seq

    def release(self, req_ids: list[str]) -> None:
        """Forget finished or aborted requests' rows (their batch rows go next step)."""
        for req_id in req_ids:
            self._seqs.pop(req_id, None)

    def forget(self, req_ids: list[str]) -> None:
        super().forget(req_ids)
        self.release(req_ids)

    @property
    def num_sequences(self) -> int:
        """Requests whose rows or sampling slot the runner holds (for leak checks)."""
        return len(self._seqs.keys() | self._slot.keys())

    # -- one step ----------------------------------------------------------------

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids | so.aborted_req_ids | so.preempted_req_ids:
            slot = self._slot.pop(req_id, None)
            if slot is not None:
                self._free_slots.append(slot)
        for req_id in so.finished_req_ids | so.aborted_req_ids:
            self._seqs.pop(req_id, None)
        super()._update_states(so)
        for new in so.scheduled_new_reqs:
            seq = self._seqs.get(new.req_id)
            if seq is None:
                raise RuntimeError(f"talker request {new.req_id!r} was scheduled without its thinker rows")
            slot = self._slot[new.req_id] = self._free_slots.pop()
            # A resumed request brings its codes so far: they count as seen too.
            self._seen[slot].zero_()
            self._seen[slot, torch.tensor(new.token_ids, device=self.device)] = True
            self._suppress[slot].zero_()
            if seq.suppress_token_ids:
                self._suppress[slot, list(seq.suppress_token_ids)] = True
            self._penalty[slot] = seq.repetition_penalty

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput()
        batch = self.input_batch
        step = batch.prepare_step(so.num_scheduled_tokens)
        inputs_embeds, positions = self._inputs(step)
        metadata = build_attention_metadata(step, self.block_size)
        hidden = self.model.forward(step.input_ids, positions, metadata, self.kv_caches, inputs_embeds=inputs_embeds)
        if not step.sampling_req_ids:
            return ModelRunnerOutput()
        req_ids = step.sampling_req_ids
        logits = self.model.compute_logits(hidden.index_select(0, step.logits_indices))
        slots = torch.tensor([self._slot[r] for r in req_ids], device=self.device)
        logits = self._apply_codec_rules(logits, slots)
        rows = step.rows[step.seq_lens == batch.num_tokens[step.rows]]
        md = self.sampling_state.metadata(batch, rows, req_ids)
        sampled = self.sampler(logits, md, self.generator).sampled_token_ids
        self._seen[slots, sampled] = True
        token_ids = sampled.tolist()
        for req_id, token in zip(req_ids, token_ids):
            batch.append_token(req_id, token)
        return ModelRunnerOutput(req_ids=list(req_ids), sampled_token_ids=dict(zip(req_ids, token_ids)))

    def _inputs(self, step: BatchStep) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, thinker_hidden]`` inputs (before projection) and ``[3, T]`` positions."""
        rows: list[torch.Tensor] = []
        positions: list[torch.Tensor] = []
        is_code = np.zeros(step.num_tokens, dtype=bool)
        starts = step.num_computed_tokens.tolist()
        ends = step.seq_lens.tolist()
        offsets = step.query_start_loc.tolist()
        # One pass per request: each contributes a slice of its prefill rows and/or
        # its reply rows; a single cat below copies them into the step's input.
        for req_id, start, end, offset in zip(step.req_ids, starts, ends, offsets):
            prompt = self._seqs[req_id].prompt
            num_prompt = prompt.num_prompt_tokens
            if start < num_prompt:
                stop = min(end, num_prompt)
                rows.append(prompt.prefill_embeds[start:stop])
                positions.append(prompt.positions[:, start:stop])
            if end > num_prompt:
                first = max(start, num_prompt)
                last_reply = prompt.reply.shape[0] - 1
                lo, hi = first - num_prompt, end - num_prompt
                if hi - 1 <= last_reply:
                    rows.append(prompt.reply[lo:hi])
                else:  # past the reply: its last row (tts_text_pad) repeats
                    rows.append(prompt.reply[torch.arange(lo, hi).clamp_(max=last_reply)])
                idx = torch.arange(first, end, device=prompt.positions.device) + prompt.rope_delta
                positions.append(idx.to(prompt.positions.dtype).expand(3, -1))
                is_code[offset + first - start : offset + end - start] = True
        x = torch.cat(rows) if len(rows) > 1 else rows[0]
        pos = torch.cat(positions, dim=1) if len(positions) > 1 else positions[0]
        if is_code.any():
            mask = torch.from_numpy(is_code).to(x.device)
            # codec_embed(code) + reply row, as the reference adds them (one lookup for the step).
            x = torch.where(mask[:, None], self.model.embed_codec(step.input_ids[: step.num_tokens]) + x, x)
        return x, pos.to(self.device)

    def _apply_codec_rules(self, logits: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """transformers' RepetitionPenaltyLogitsProcessor then SuppressTokensLogitsProcessor."""
        penalty = self._penalty[slots.cpu().numpy()]
        if (penalty != 1.0).any():
            p = torch.from_numpy(penalty).to(logits.device)[:, None]
            penalized = torch.where(logits < 0, logits * p, logits / p)
            logits = torch.where(self._seen.index_select(0, slots), penalized, logits)
        return logits.masked_fill(self._suppress.index_select(0, slots), float("-inf"))
