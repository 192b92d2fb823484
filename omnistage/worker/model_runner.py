"""Runs one scheduled step on the model: batch bookkeeping, forward, sampling."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from omnistage.core.sched_output import SchedulerOutput
from omnistage.worker.attention import allocate_kv_caches, build_attention_metadata
from omnistage.worker.input_batch import BatchStep, InputBatch
from omnistage.worker.runner_output import ModelRunnerOutput
from omnistage.worker.sampler import Sampler, SamplerOutput, SamplingState


class ModelRunner:
    """Owns the paged KV caches and the persistent batch of one model.

    Each step it mirrors the scheduler's decisions into ``InputBatch`` (drop
    rows that left, add new or resumed requests, extend block tables), runs
    one packed, unpadded forward over every scheduled token, computes logits
    only at the last token of requests that sample, and samples.
    """

    def __init__(
        self,
        loaded_model: Any,
        block_size: int,
        num_kv_blocks: int,
        max_num_seqs: int,
        max_model_len: int,
        device: str | torch.device = "cpu",
        seed: int = 0,
    ) -> None:
        self.model = loaded_model.model
        self.device = torch.device(device)
        self.block_size = block_size
        m = self.model
        self.kv_caches = allocate_kv_caches(
            m.num_layers, num_kv_blocks, block_size, m.num_kv_heads, m.head_dim, m.dtype, self.device
        )
        self.input_batch = InputBatch(max_num_seqs, max_model_len, block_size, self.device)
        eos = list(loaded_model.eos_token_ids or [])
        self.sampling_state = SamplingState(max_num_seqs, m.vocab_size, eos, self.device)
        self.sampler = Sampler()
        # Unseeded requests draw from one engine-wide generator, so a run with
        # the same engine seed and the same arrivals repeats itself.
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        # A preempted seeded request resumes its random stream where it left off.
        self._parked_generators: dict[str, torch.Generator] = {}

    # -- batch bookkeeping ----------------------------------------------------

    def _remove(self, req_id: str) -> None:
        batch = self.input_batch
        row = batch.remove_request(req_id)
        if row is not None and row < batch.num_reqs:  # the last row moved into the hole
            self.sampling_state.set_row(row, batch.sampling_params[batch.req_ids[row]])

    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in so.finished_req_ids | so.aborted_req_ids:
            self._parked_generators.pop(req_id, None)
            self._remove(req_id)
        for req_id in so.preempted_req_ids:
            gen = batch.generators.get(req_id)
            if gen is not None:
                self._parked_generators[req_id] = gen
            self._remove(req_id)
        for new in so.scheduled_new_reqs:
            row = batch.add_request(
                new.req_id,
                new.token_ids,
                new.num_prompt_tokens,
                new.num_computed_tokens,
                new.block_ids,
                new.sampling_params,
            )
            parked = self._parked_generators.pop(new.req_id, None)
            if parked is not None:
                batch.generators[new.req_id] = parked
            self.sampling_state.set_row(row, new.sampling_params)
        for cached in so.scheduled_cached_reqs:
            batch.update_request(cached.req_id, cached.new_block_ids, cached.num_computed_tokens)

    def forget(self, req_ids: list[str]) -> None:
        """Drop the parked RNG of requests that ended while preempted: the
        scheduler reports only requests the worker holds a row for."""
        for req_id in req_ids:
            self._parked_generators.pop(req_id, None)

    # -- one step --------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput()
        batch = self.input_batch
        step = batch.prepare_step(so.num_scheduled_tokens)
        hidden = self._forward(step)
        if not step.sampling_req_ids:
            return ModelRunnerOutput()
        logits = self.model.compute_logits(hidden.index_select(0, step.logits_indices))
        rows = step.rows[step.seq_lens == batch.num_tokens[step.rows]]  # rows of sampling_req_ids
        md = self.sampling_state.metadata(
            rows, step.sampling_req_ids, batch.num_tokens[rows] - batch.num_prompt_tokens[rows], batch.generators
        )
        sampled = self.sampler(logits, md, self.generator)
        token_ids = sampled.sampled_token_ids.tolist()
        for req_id, token in zip(step.sampling_req_ids, token_ids):
            batch.append_token(req_id, token)
        out = ModelRunnerOutput(
            req_ids=list(step.sampling_req_ids), sampled_token_ids=dict(zip(step.sampling_req_ids, token_ids))
        )
        if md.num_logprobs is not None:
            out.logprobs = _logprob_dicts(step.sampling_req_ids, token_ids, md.num_logprobs, sampled)
        return out

    def _forward(self, step: BatchStep) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden]`` of the step's packed tokens.

        Text-only models embed ``input_ids`` inside the forward; a multimodal
        model would build ``inputs_embeds`` here (``ModelState``) first.
        """
        metadata = build_attention_metadata(step, self.block_size)
        return self.model.forward(step.input_ids, step.positions, metadata, self.kv_caches)


def _logprob_dicts(
    req_ids: list[str], token_ids: list[int], num_logprobs: list[int], sampled: SamplerOutput
) -> dict[str, dict[int, float]]:
    """``{token: logprob}`` per request that asked: the sampled token and its top-N."""
    assert sampled.sampled_logprobs is not None
    lp = sampled.sampled_logprobs.tolist()
    top_ids = sampled.topk_token_ids.tolist() if sampled.topk_token_ids is not None else None
    top_lp = sampled.topk_logprobs.tolist() if sampled.topk_logprobs is not None else None
    out: dict[str, dict[int, float]] = {}
    for i in np.flatnonzero(np.asarray(num_logprobs) >= 0):
        d = {token_ids[i]: lp[i]}
        n = num_logprobs[i]
        if n and top_ids is not None:
            for t, v in zip(top_ids[i][:n], top_lp[i][:n]):
                d.setdefault(t, v)
        out[req_ids[i]] = d
    return out
