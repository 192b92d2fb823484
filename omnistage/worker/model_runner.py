"""Runs one scheduled step on the model: batch bookkeeping, forward, sampling."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from omnistage.attention.kv_cache import invalidate_dense_view, zero_blocks
from omnistage.attention.paged_attention import (
    allocate_kv_caches,
    build_attention_metadata,
)
from omnistage.core.runner_output import ModelRunnerOutput
from omnistage.core.sched_output import NewRequestData, SchedulerOutput
from omnistage.models.interface import tensor_cache_policy_of
from omnistage.worker.host_copy import (
    CopyDevice,
    CudaCopyDevice,
    HostCopier,
    PendingRows,
)
from omnistage.worker.input_batch import BatchStep, InputBatch
from omnistage.worker.mm.encoder_cache import EncoderCache
from omnistage.worker.model_state import ModelState
from omnistage.worker.eagle_proposer import EagleProposer
from omnistage.worker.rejection_sampler import RejectionSampler
from omnistage.worker.sampler import Sampler, SamplerOutput, SamplingMetadata, SamplingState
from omnistage.worker.tensor_prefix_cache import StepTensorCache

logger = logging.getLogger(__name__)

# Prompt positions whose logits are made at once for prompt logprobs: [128, V] fp32 is 25 MB at
# V = 49k, 78 MB at Qwen's 152k (a whole 8k-token chunk's would be 1.6 and 5 GB).
PROMPT_LOGPROBS_ROWS = 128


@dataclass
class StepModelInputs:
    """What one step's forward reads."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T], or [3, T] (temporal, height, width) for M-RoPE models
    inputs_embeds: torch.Tensor | None = None  # [T, hidden] when encoder rows were merged in
    is_mm_embed: torch.Tensor | None = None  # [T] bool (CPU): the positions holding encoder rows


class ModelRunner:
    """Owns the paged KV caches and the persistent batch of one model; every stage runs one.

    Each step it mirrors the scheduler's decisions into ``InputBatch`` (drop
    rows that left, add new or resumed requests, extend block tables), runs
    one packed, unpadded forward over every scheduled token, computes logits
    only at the last token of requests that sample, and samples.

    What a model adds is declared by the model (``models.interface``), never
    by a runner subclass:

    - **Media** (``loaded_model.mm_adapter`` set): a ``ModelState`` with an
      ``EncoderCache``. Each step frees the encoder outputs the scheduler
      evicted, encodes the scheduled items, merges the window's encoder rows
      into ``inputs_embeds``, and runs at M-RoPE positions (``[3, T]``; a
      request's prompt table is computed once when it joins, generated tokens
      sit at ``index + delta``).
    - **Per-request payloads** (the model has ``step_inputs``): the step's
      input embeddings and positions are built by the model from each
      request's ``payload``, which arrives with the request in the scheduler
      output and is kept until the request leaves the batch.
    - **Per-token outputs** (the model has ``per_token_outputs``): for
      requests with ``return_hidden_states``, each step's rows go back in
      ``ModelRunnerOutput.hidden_states`` (CPU), prefix rows included on a KV
      prefix hit, served by the tensor prefix cache that the model's
      ``tensor_cache_policy`` asks for. Deferred keys (known after sampling)
      are staged there and committed when the request finishes.

    ``enable_tensor_cache=False`` builds no tensor prefix cache: a prefix hit
    then leaves a request that returns per-token rows short of its prefix,
    which the engine reports at its hand-off.
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
        max_num_batched_tokens: int | None = None,
        enable_tensor_cache: bool = True,
        drafter: Any | None = None,
        copy_device: CopyDevice | None = None,
    ) -> None:
        self.model = loaded_model.model
        self.device = torch.device(device)
        # Per-token rows leave a CUDA device through a side stream into reused pinned
        # buffers; ``copy_device`` replaces that device half (tests: DeferredCopyDevice).
        if copy_device is None and self.device.type == "cuda":
            copy_device = CudaCopyDevice(self.device)
        self.host_copier = HostCopier(copy_device) if copy_device is not None else None
        self.block_size = block_size
        m = self.model
        self.kv_caches = allocate_kv_caches(
            m.num_layers, num_kv_blocks, block_size, m.num_kv_heads, m.head_dim, m.dtype, self.device
        )
        self.input_batch = InputBatch(max_num_seqs, max_model_len, block_size, self.device)
        eos = list(loaded_model.eos_token_ids or [])
        self.sampling_state = SamplingState(max_num_seqs, m.vocab_size, eos, self.device)
        self.sampler = Sampler()
        self.rejection_sampler = RejectionSampler()
        # Unseeded requests draw from one engine-wide generator, so a run with
        # the same engine seed and the same arrivals repeats itself.
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        # A preempted seeded request resumes its random stream where it left off.
        self._parked_generators: dict[str, torch.Generator] = {}
        # Multimodal models: encoder cache + runner, and per-request positions.
        self.mm_adapter = getattr(loaded_model, "mm_adapter", None)
        self.encoder_cache: EncoderCache | None = None
        self.model_state: ModelState | None = None
        if self.mm_adapter is not None:
            self.encoder_cache = EncoderCache()
            self.model_state = ModelState(
                self.mm_adapter, self.encoder_cache, max_num_batched_tokens or max_model_len,
                m.hidden_size, m.dtype, self.device,
            )  # fmt: skip
        # req id -> its prompt's M-RoPE table [3, P] (requests with items only;
        # a text prompt's positions are its indices)
        self._mrope_prompt: dict[str, np.ndarray] = {}
        self.num_encoded_items = 0  # items run through an encoder tower, for tests and benchmarks
        # Encoder workers (EPD): the engine's RemoteEncoderPool, and the items
        # loaded from it / encoded here because a load failed.
        self.remote_encoder: Any = None
        self.num_loaded_items = 0
        self.num_reencoded_items = 0
        # Per-request payloads (models whose inputs are built per request) and
        # the requests whose per-token outputs go back each step.
        self._payloads: dict[str, Any] = {}
        self._returns_rows: set[str] = set()
        # Requests of this step that could not join the batch (their error): they fail alone.
        self._failed: dict[str, str] = {}
        # The declarations sit on the multimodal adapter when there is one, else on the model.
        self.stage_model = self.mm_adapter or self.model
        policy = tensor_cache_policy_of(self.stage_model)
        self._deferred_keys = policy.deferred_keys
        self.tensor_cache: StepTensorCache | None = None
        if enable_tensor_cache and policy.caches_anything:
            self.tensor_cache = StepTensorCache(policy, num_kv_blocks, block_size, m.hidden_size, m.dtype)
        # Speculative decoding with a worker-side drafter (an EAGLE head): after each target
        # forward it runs over the verified tokens (or keeps them, for a request that does
        # not draft, until it does: worker/eagle_proposer.py) and drafts for the next step.
        self.proposer: EagleProposer | None = None
        if drafter is not None:
            self.proposer = EagleProposer(
                drafter, m, num_kv_blocks, block_size, max_model_len, self.device, max_num_seqs
            )

    # -- batch bookkeeping ----------------------------------------------------

    def _remove(self, req_id: str) -> None:
        # A preempted request comes back as new, bringing its payload again.
        self._payloads.pop(req_id, None)
        if self.proposer is not None:
            self.proposer.discard(req_id)  # released (caught up) first when it left normally
        self._returns_rows.discard(req_id)
        if self.encoder_cache is not None:
            self.encoder_cache.remove_request(req_id)  # its encoder outputs stay: they are shared
            self._mrope_prompt.pop(req_id, None)
        batch = self.input_batch
        row = batch.remove_request(req_id)
        if row is not None and row < batch.num_reqs:  # the last row moved into the hole
            self.sampling_state.set_row(row, batch.sampling_params[batch.req_ids[row]])

    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        try:
            if self.tensor_cache is not None:
                # Deferred outputs of finished requests are committed while their rows still exist.
                self.tensor_cache.begin_step(so, batch)
            leaving = so.finished_req_ids | so.aborted_req_ids | so.preempted_req_ids
            if leaving and self.proposer is not None:
                self._release_drafter(leaving)
        finally:
            # Leaving rows go even when the above failed: no later step names them again, and a
            # row left behind would be held for good (and keep the engine from ever going idle).
            for req_id in so.finished_req_ids | so.aborted_req_ids:
                self._parked_generators.pop(req_id, None)
                self._remove(req_id)
            for req_id in so.preempted_req_ids:
                gen = batch.generators.get(req_id)
                if gen is not None:
                    self._parked_generators[req_id] = gen
                self._remove(req_id)
        if self.encoder_cache is not None:
            # Evicted by the scheduler: drop before this step encodes (an id
            # re-allocated in the same pass is never in this list).
            for mm_hash in so.free_encoder_mm_hashes:
                self.encoder_cache.free_encoder_cache(mm_hash)
        self._failed = {}
        for new in so.scheduled_new_reqs:
            try:
                self._add_new_request(new)
            except Exception as exc:  # noqa: BLE001 - one request's bad state fails it alone
                self._remove(new.req_id)
                self._failed[new.req_id] = f"{type(exc).__name__}: {exc}"
        for cached in so.scheduled_cached_reqs:
            batch.update_request(cached.req_id, cached.new_block_ids, cached.num_computed_tokens)
        # What an ended request left in the blocks given out now must not reach their new owner.
        fresh = so.fresh_block_ids(self.block_size)
        for caches in (self.kv_caches, self.proposer.kv_caches if self.proposer is not None else None):
            if caches is not None:
                zero_blocks(caches, fresh)
        if self.tensor_cache is not None:
            self.tensor_cache.rows_added(so, fresh)
        if so.scheduled_new_reqs:
            # The dense decode views know requests by id, and an id may come back once its request
            # ended: the new request must not continue the old one's keys. This costs nothing: a
            # step a request joins never continues a view (it was not in the step before).
            for cache in self.kv_caches + (self.proposer.kv_caches if self.proposer is not None else []):
                invalidate_dense_view(cache)

    def _add_new_request(self, new: NewRequestData) -> None:
        batch = self.input_batch
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
        if self.encoder_cache is not None:
            self._add_mm_request(new, row)
        if new.payload is not None:
            self._payloads[new.req_id] = new.payload
        if new.return_hidden_states:
            self._returns_rows.add(new.req_id)

    def _add_mm_request(self, new: NewRequestData, row: int) -> None:
        """Register a request's items with the encoder cache (text prompts too:
        the gather looks every prompt up) and compute its M-RoPE table."""
        features = list(new.mm_features)
        self.encoder_cache.add_request(new.req_id, features)
        if features:
            try:
                mrope = self.mm_adapter.get_mrope_positions(new.token_ids[: new.num_prompt_tokens], features)
            except (TypeError, ValueError, IndexError) as exc:  # the model's own reading of the prompt
                raise ValueError(
                    f"the prompt's M-RoPE positions could not be computed ({type(exc).__name__}: {exc}); "
                    "its text may hold a media marker token (e.g. <|audio_bos|>) without its item"
                ) from exc
            self._mrope_prompt[new.req_id] = mrope.prompt.cpu().numpy()
            self.input_batch.mrope_delta[row] = mrope.delta

    def _release_drafter(self, leaving: set[str]) -> None:
        """The head's owed positions of leaving requests, while their rows are still here.
        Best effort: a failed pass leaves those positions' head KV stale, which only the
        quality of drafts read over them (a prefix hit) can show; nothing in flight fails."""
        assert self.proposer is not None
        try:
            self.proposer.release(leaving, self.input_batch)
        except Exception:  # noqa: BLE001 - contained: drafts are verified, their quality is all it costs
            logger.exception("EAGLE head: the catch-up pass of leaving requests %s failed", sorted(leaving))

    def forget(self, req_ids: list[str]) -> None:
        """Drop what the runner keeps of requests that ended while preempted (their
        parked RNG, staged tensors): the scheduler reports only requests the
        worker holds a row for."""
        for req_id in req_ids:
            self._parked_generators.pop(req_id, None)
        if self.tensor_cache is not None:
            self.tensor_cache.discard(req_ids)

    # -- one step --------------------------------------------------------------

    @property
    def num_rows(self) -> int:
        """Requests in the persistent batch, those that ended since the last step included."""
        return self.input_batch.num_reqs

    @property
    def num_parked_generators(self) -> int:
        """Random streams of preempted seeded requests, kept until they resume or end."""
        return len(self._parked_generators)

    @property
    def num_payloads(self) -> int:
        """Requests whose payload or per-token flag the runner holds (for leak checks)."""
        return len(self._payloads.keys() | self._returns_rows)

    def holds_encoder_output(self, identifier: str) -> bool:
        """Whether the encoder cache holds the output of the item with this identifier."""
        return self.encoder_cache is not None and identifier in self.encoder_cache.encoder_outputs

    @property
    def num_drafter_kept(self) -> int:
        """Requests whose EAGLE head pass is owed (kept target rows; for leak checks)."""
        return self.proposer.num_kept_requests if self.proposer is not None else 0

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        num_scheduled = so.num_scheduled_tokens
        if self._failed:
            num_scheduled = {r: n for r, n in num_scheduled.items() if r not in self._failed}
        if not num_scheduled:
            return ModelRunnerOutput(failed_req_ids=dict(self._failed))
        drafts = {r: d for r, d in so.scheduled_spec_decode_tokens.items() if r in num_scheduled}
        step = self._prepare_step(num_scheduled, drafts)
        inputs = self.prepare_model_inputs(step, so)
        metadata = build_attention_metadata(step, self.block_size)
        hidden = self.model.forward(
            inputs.input_ids, inputs.positions, metadata, self.kv_caches, inputs_embeds=inputs.inputs_embeds
        )
        prompt_logprobs = self._prompt_logprobs(step, hidden)
        if drafts:
            out = self._sample_with_drafts(step, hidden, drafts)
            # From here on only verified tokens count: rejected drafts' rows never
            # reach the tensor prefix cache, a later stage or the drafter. (The rows'
            # copy cannot overlap sampling here: which rows are valid is known after.)
            keep = None
            if out.spec_sampled_token_ids:
                verified, kept_hidden, keep = self._verified(step, hidden, out.spec_sampled_token_ids)
            # The model makes the per-token rows of the step it ran (it may read tensors it
            # captured during that forward), and they are cut like the step.
            pending_rows = self._start_per_token_rows(step, hidden, keep)
            if keep is not None:
                step, hidden = verified, kept_hidden
        else:
            pending_rows = self._start_per_token_rows(step, hidden)  # copied to the host under sampling
            out = self.sample(step, hidden)
        rows = self._per_token_rows(step, *pending_rows) if pending_rows else {}
        if rows:
            out.hidden_states = rows
        out.prompt_logprobs = prompt_logprobs
        if self._deferred_keys:
            # Known only now (they depend on the sampled tokens; the model may also need
            # them for its next inputs): staged until the request finishes, dropped if it
            # is aborted or preempted first.
            deferred = self.stage_model.deferred_outputs(step, hidden, out)
            if deferred and self.tensor_cache is not None:
                self.tensor_cache.stage_deferred(step, self.input_batch, deferred)
        if self.proposer is not None:
            out.draft_token_ids = self.proposer.propose(
                step, hidden, self.input_batch, so.draft_token_requests, self.model_state
            )
        out.failed_req_ids = dict(self._failed)
        return out

    def _prompt_logprobs(self, step: BatchStep, hidden: torch.Tensor) -> dict[str, tuple[int, list[dict[int, float]]]]:
        """For the requests that ask: each prompt token's logprob (the raw log-softmax at the
        position before it, as sampled tokens report theirs) and the top-N there, for the
        positions this step ran (``ModelRunnerOutput.prompt_logprobs``)."""
        top_n = self.sampling_state.num_prompt_logprobs[step.rows]
        if top_n.max(initial=-1) < 0:  # nobody asks: the common step pays one array read
            return {}
        start = step.num_computed_tokens
        # Position p scores prompt token p + 1: positions up to the prompt's second to last.
        count = np.minimum(start + step.num_scheduled_tokens, step.prefill_lens - 1) - start
        out = {}
        for i in np.flatnonzero((top_n >= 0) & (count > 0)).tolist():
            first, n, k = int(step.query_start_loc[i]), int(count[i]), int(top_n[i])
            targets = self.input_batch.token_ids_cpu[step.rows[i], start[i] + 1 : start[i] + 1 + n].tolist()
            entries: list[dict[int, float]] = []
            for lo in range(0, n, PROMPT_LOGPROBS_ROWS):
                part = targets[lo : lo + PROMPT_LOGPROBS_ROWS]
                logits = self.model.compute_logits(hidden[first + lo : first + lo + len(part)])
                logprobs = torch.log_softmax(logits.float(), dim=-1)
                ids = torch.tensor(part, device=logprobs.device)
                chosen = logprobs.gather(1, ids[:, None]).squeeze(1).tolist()
                entries += [{t: v} for t, v in zip(part, chosen)]
                if k:
                    values, tokens = logprobs.topk(k, dim=-1)
                    for entry, top_ids, top_lp in zip(entries[lo:], tokens.tolist(), values.tolist()):
                        for t, v in zip(top_ids, top_lp):
                            entry.setdefault(t, v)
            out[step.req_ids[i]] = (int(start[i]) + 1, entries)
        return out

    def _verified(
        self, step: BatchStep, hidden: torch.Tensor, emitted: dict[str, list[int]]
    ) -> tuple[BatchStep, torch.Tensor, torch.Tensor]:
        """The step cut to its verified tokens: a speculating request keeps its
        last known token and its accepted drafts (as many as it emitted
        tokens), the others all their tokens; with the hidden rows to match,
        and the index of the kept rows in the step."""
        n = step.num_scheduled_tokens.copy()
        for i, req_id in enumerate(step.req_ids):
            tokens = emitted.get(req_id)
            if tokens is not None:
                n[i] = len(tokens)
        qsl = step.query_start_loc
        keep = np.concatenate([np.arange(qsl[i], qsl[i] + n[i]) for i in range(len(n))]) if len(n) else qsl[:0]
        index = torch.from_numpy(keep).to(self.device)
        new_qsl = np.zeros_like(qsl)
        np.cumsum(n, out=new_qsl[1:])
        seq_lens = step.num_computed_tokens + n
        sampled = set(step.sampling_req_ids)
        samples = np.fromiter((r in sampled for r in step.req_ids), dtype=bool, count=len(step.req_ids))
        verified = dataclasses.replace(
            step,
            num_scheduled_tokens=n,
            query_start_loc=new_qsl,
            seq_lens=seq_lens,
            num_tokens=int(new_qsl[-1]),
            input_ids=step.input_ids.index_select(0, index),
            positions=step.positions.index_select(0, index),
            slot_mapping=step.slot_mapping.index_select(0, index),
            logits_indices=torch.from_numpy(new_qsl[1:][samples] - 1).to(self.device),
        )
        return verified, hidden.index_select(0, index), index

    def _prepare_step(self, num_scheduled: dict[str, int], drafts: dict[str, list[int]]) -> BatchStep:
        """The packed batch; draft tokens are written after their requests'
        known tokens for this step only (the batch's token counts are left as
        they were: the verified tokens are appended after sampling)."""
        batch = self.input_batch
        if not drafts:
            return batch.prepare_step(num_scheduled)
        known: dict[int, int] = {}
        for req_id, tokens in drafts.items():
            row = batch.req_id_to_index[req_id]
            n = known[row] = int(batch.num_tokens[row])
            batch.token_ids_cpu[row, n : n + len(tokens)] = tokens
            batch.num_tokens[row] = n + len(tokens)
        try:
            return batch.prepare_step(num_scheduled)
        finally:
            for row, n in known.items():
                batch.num_tokens[row] = n

    def prepare_model_inputs(self, step: BatchStep, so: SchedulerOutput) -> StepModelInputs:
        """Token ids and positions; a payload-driven model builds its input
        embeddings and positions from the requests' payloads; a multimodal
        model also runs the scheduled encoders and merges the window's
        encoder rows.

        ``inputs_embeds`` stays None when no encoder row falls in the step
        (decodes, text prompts): the forward then embeds the ids itself,
        which is the same computation without the extra copy."""
        step_inputs = getattr(self.model, "step_inputs", None)
        if step_inputs is not None:
            embeds, positions = step_inputs(step, [self._payloads[r] for r in step.req_ids])
            return StepModelInputs(step.input_ids, positions.to(self.device), embeds)
        if self.model_state is None:
            return StepModelInputs(step.input_ids, step.positions)
        state = self.model_state
        # A request that failed to join the batch this step fails alone: its items are not encoded,
        # unless a request of the step took a hit on the same content (_adopt_orphaned_items).
        scheduled = {r: ids for r, ids in so.scheduled_encoder_inputs.items() if r not in self._failed}
        if so.remote_encoder_inputs:
            scheduled = self._load_remote_outputs(so.remote_encoder_inputs, scheduled)
        if self._failed:
            self._adopt_orphaned_items(so, scheduled)
        if scheduled:
            state.execute_mm_encoder(scheduled)
            self.num_encoded_items += sum(len(v) for v in scheduled.values())
        inputs = StepModelInputs(step.input_ids, self._mrope_positions(step))
        mm_rows, is_mm_embed = state.gather_mm_embeddings(step)
        begin_step = getattr(self.mm_adapter, "begin_step", None)
        if begin_step is not None:  # rows an adapter adds past the embeddings (Qwen3-Omni's deepstack)
            begin_step(mm_rows, is_mm_embed if mm_rows else None)
        if mm_rows:
            inputs.inputs_embeds = state.encoder_runner.get_inputs_embeds(
                step.input_ids[: step.num_tokens], mm_rows, is_mm_embed
            )
            inputs.is_mm_embed = is_mm_embed
        return inputs

    def _adopt_orphaned_items(self, so: SchedulerOutput, scheduled: dict[str, list[int]]) -> None:
        """Items planned for requests that failed to join the batch, whose content a
        request of this step also carries (it took a hit on the entry in the same pass
        and reads it now): encoded for that request. Items no one else reads are not
        encoded; the engine then forgets their entries."""
        failed = {new.req_id: new.mm_features for new in so.scheduled_new_reqs if new.req_id in self._failed}
        orphans = {
            failed[req_id][k].identifier
            for plan in (so.scheduled_encoder_inputs, so.remote_encoder_inputs)
            for req_id, ids in plan.items()
            if req_id in failed
            for k in ids
        }
        features = self.encoder_cache.mm_features
        for req_id in so.num_scheduled_tokens:
            if not orphans:
                break
            for k, feature in enumerate(features.get(req_id, ())):
                if feature.identifier in orphans:
                    orphans.discard(feature.identifier)
                    scheduled.setdefault(req_id, []).append(k)

    def _load_remote_outputs(
        self, remote: dict[str, list[int]], scheduled: dict[str, list[int]]
    ) -> dict[str, list[int]]:
        """Put the outputs encoder workers published into the encoder cache;
        return ``scheduled`` plus the items that could not be loaded, which
        are encoded here like any other (a worker's failure is never the
        request's)."""
        outputs = self.encoder_cache.encoder_outputs
        features = self.encoder_cache.mm_features
        local = {req_id: list(ids) for req_id, ids in scheduled.items()}
        dtype, device = self.model.dtype, self.device
        for req_id, ids in remote.items():
            if req_id not in features:  # it failed to join the batch this step
                continue
            for k in ids:
                feature = features[req_id][k]
                if feature.identifier in outputs:
                    continue
                out = None
                if self.remote_encoder is not None:
                    out = self.remote_encoder.load(
                        feature.identifier, feature.mm_position.get_num_embeds(), dtype, device
                    )
                if out is None:
                    local.setdefault(req_id, []).append(k)
                    self.num_reencoded_items += 1
                else:
                    outputs[feature.identifier] = out
                    self.num_loaded_items += 1
        return local

    def _mrope_positions(self, step: BatchStep) -> torch.Tensor:
        """``[3, T]`` positions: ``index + delta`` on every axis, vectorized
        over the batch, then the prompt tables for the prompt windows of
        requests with items (one copy per such request)."""
        n = step.num_scheduled_tokens
        computed = step.num_computed_tokens
        qsl = step.query_start_loc
        index = np.repeat(computed - qsl[:-1], n) + np.arange(step.num_tokens)
        positions = np.empty((3, step.num_tokens), dtype=np.int64)
        positions[:] = index + np.repeat(self.input_batch.mrope_delta[step.rows], n)
        if self._mrope_prompt:
            for i in np.flatnonzero(computed < step.prefill_lens).tolist():
                table = self._mrope_prompt.get(step.req_ids[i])
                if table is None:
                    continue
                start = int(computed[i])
                stop = min(start + int(n[i]), table.shape[1])
                positions[:, qsl[i] : qsl[i] + stop - start] = table[:, start:stop]
        return torch.from_numpy(positions).to(self.device)

    def _start_per_token_rows(
        self, step: BatchStep, hidden: torch.Tensor, keep: torch.Tensor | None = None
    ) -> tuple | None:
        """Begin this step's per-token outputs: None when no request reads rows and
        none are cached; else what ``_per_token_rows`` needs, with the rows' copy to
        the host started (on a device, a side-stream copy that sampling overlaps).
        ``keep``: only these rows of the step (its verified tokens)."""
        wanted = [i for i, r in enumerate(step.req_ids) if r in self._returns_rows] if self._returns_rows else []
        cache = self.tensor_cache
        if cache is not None and not cache.policy.full_prefix_hidden:
            cache = None  # it caches deferred keys only: no rows to write or merge here
        if not wanted and cache is None:
            return None  # no extra work
        n = step.num_tokens
        states = self.stage_model.per_token_outputs(hidden[:n], step.input_ids[:n])
        if keep is not None:
            states = states.index_select(0, keep)
        if self.host_copier is not None:
            return wanted, cache, self.host_copier.start(states)
        return wanted, cache, states

    def _per_token_rows(
        self, step: BatchStep, wanted: list[int], cache: StepTensorCache | None, states: Any
    ) -> dict[str, torch.Tensor]:
        """This step's per-token outputs of the requests that return them, on the host,
        with the cached prefix rows merged in for a request's first step after a hit;
        also written to the tensor prefix cache for later hits."""
        if isinstance(states, PendingRows):
            states = states.wait()  # the step's one wait on the copy, shared by all uses
        elif states.device.type != "cpu":
            states = states.to("cpu")
        if cache is None:
            parts = torch.split_with_sizes(states, step.num_scheduled_tokens.tolist())
            return {step.req_ids[i]: parts[i] for i in wanted}
        cache.write(step, states)
        # Views of this step's ``states`` (merged copies on hits); the host buffer
        # under them is reused only once the consumers have freed every view.
        return cache.merge(step, self.input_batch, states, wanted) if wanted else {}

    def sample(self, step: BatchStep, hidden: torch.Tensor) -> ModelRunnerOutput:
        """Logits at the last token of the requests that sample, then tokens."""
        if not step.sampling_req_ids:
            return ModelRunnerOutput()
        rows = step.rows[step.seq_lens == self.input_batch.num_tokens[step.rows]]  # rows of sampling_req_ids
        return self._sample_rows(step.sampling_req_ids, rows, step.logits_indices, hidden)

    def _sample_rows(
        self,
        req_ids: list[str],
        rows: np.ndarray,
        logits_indices: torch.Tensor,
        hidden: torch.Tensor,
        md: SamplingMetadata | None = None,
        greedy_ids: torch.Tensor | None = None,
    ) -> ModelRunnerOutput:
        """One token for each of ``req_ids`` (batch ``rows``), from the hidden
        state at ``logits_indices``; ``md``, their sampling metadata, and
        ``greedy_ids``, their argmax tokens (plain-greedy rows), where the
        caller has them already."""
        batch = self.input_batch
        if md is None:
            md = self.sampling_state.metadata(batch, rows, req_ids)
        greedy_tokens = getattr(self.model, "greedy_token_ids", None)
        if greedy_ids is None and md.plain_greedy and greedy_tokens is not None:
            # Only argmax tokens are needed: the model may get them without full fp32 logits.
            greedy_ids = greedy_tokens(hidden.index_select(0, logits_indices))
        if greedy_ids is not None:
            sampled = SamplerOutput(sampled_token_ids=greedy_ids)
        else:
            logits = self.model.compute_logits(hidden.index_select(0, logits_indices))
            sampled = self.sampler(logits, md, self.generator)
        token_ids = sampled.sampled_token_ids.tolist()
        for req_id, token in zip(req_ids, token_ids):
            batch.append_token(req_id, token)
        out = ModelRunnerOutput(req_ids=list(req_ids), sampled_token_ids=dict(zip(req_ids, token_ids)))
        if md.num_logprobs is not None:
            out.logprobs = _logprob_dicts(req_ids, token_ids, md.num_logprobs, sampled)
        return out

    def _sample_with_drafts(
        self, step: BatchStep, hidden: torch.Tensor, drafts: dict[str, list[int]]
    ) -> ModelRunnerOutput:
        """A step with speculating requests: the others sample as usual; each
        speculating request gets logits at its ``1 + k`` positions (its last
        known token and each draft) and the rejection sampler picks what it
        emits. Outputs stay in batch order."""
        batch = self.input_batch
        plain_ids: list[str] = []
        plain_idx: list[int] = []
        spec_ids: list[str] = []
        spec_pos: list[int] = []
        last = step.logits_indices.tolist()
        for req_id, idx in zip(step.sampling_req_ids, last):
            d = drafts.get(req_id)
            if d is None:
                plain_ids.append(req_id)
                plain_idx.append(idx)
            else:
                spec_ids.append(req_id)
                spec_pos.extend(range(idx - len(d), idx + 1))
        spec_drafts = [drafts[r] for r in spec_ids]
        rep_ids = [r for r, d in zip(spec_ids, spec_drafts) for _ in range(len(d) + 1)]
        rep_rows = np.fromiter((batch.req_id_to_index[r] for r in rep_ids), dtype=np.int64, count=len(rep_ids))
        # Position j of a request's run verifies as if its drafts before j were decoded.
        drafted = [d[:j] for d in spec_drafts for j in range(len(d) + 1)]
        md = self.sampling_state.metadata(batch, rep_rows, rep_ids, drafted)
        plain_rows = np.fromiter((batch.req_id_to_index[r] for r in plain_ids), dtype=np.int64, count=len(plain_ids))
        plain_md = self.sampling_state.metadata(batch, plain_rows, plain_ids) if plain_ids else None
        greedy_tokens = getattr(self.model, "greedy_token_ids", None)
        plain_tokens = verify_tokens = None
        if md.plain_greedy and greedy_tokens is not None:  # the same argmax a plain decode takes
            # Plain greedy rows join the same LM-head pass (a row's token does not depend on the others).
            joint = plain_idx if plain_md is not None and plain_md.plain_greedy else []
            tokens = greedy_tokens(hidden.index_select(0, torch.tensor(joint + spec_pos, device=self.device)))
            plain_tokens, verify_tokens = (tokens[: len(joint)] if joint else None), tokens[len(joint) :]
        out = ModelRunnerOutput()
        if plain_ids:
            index = torch.tensor(plain_idx, device=self.device)
            out = self._sample_rows(plain_ids, plain_rows, index, hidden, plain_md, plain_tokens)
        raw_logprobs = None
        if verify_tokens is not None:
            emitted = self.rejection_sampler(None, md, spec_drafts, self.generator, verify_tokens)
        else:
            verify_rows = hidden.index_select(0, torch.tensor(spec_pos, device=self.device))
            logits = self.model.compute_logits(verify_rows)
            if md.num_logprobs is not None:  # the raw distribution at each position, as a plain decode reports
                raw_logprobs = torch.log_softmax(logits.float(), dim=-1)
            emitted = self.rejection_sampler(logits, md, spec_drafts, self.generator)
        if raw_logprobs is not None:
            assert md.num_logprobs is not None
            out.spec_logprobs = _run_logprob_lists(spec_ids, spec_drafts, emitted, md.num_logprobs, raw_logprobs)
        for req_id, tokens in zip(spec_ids, emitted):
            for token in tokens:
                batch.append_token(req_id, token)
            out.sampled_token_ids[req_id] = tokens[-1]
            out.spec_sampled_token_ids[req_id] = tokens
        order = {r: i for i, r in enumerate(step.sampling_req_ids)}
        out.req_ids = sorted(out.sampled_token_ids, key=order.__getitem__)
        return out


def _logprob_dicts(
    req_ids: list[str], token_ids: list[int], num_logprobs: list[int], sampled: SamplerOutput
) -> dict[str, dict[int, float]]:
    """``{token: logprob}`` per request that asked: the sampled token and its top-N."""
    asked = np.flatnonzero(np.asarray(num_logprobs) >= 0).tolist()
    entries = _logprob_entries(asked, token_ids, num_logprobs, sampled)
    return {req_ids[i]: d for i, d in zip(asked, entries)}


def _logprob_entries(
    rows: list[int], token_ids: list[int], num_logprobs: list[int], sampled: SamplerOutput
) -> list[dict[int, float]]:
    """``{token: logprob}`` for each of ``rows``: its token, then its top-N (``num_logprobs[row]``)."""
    assert sampled.sampled_logprobs is not None
    lp = sampled.sampled_logprobs.tolist()
    top_ids = sampled.topk_token_ids.tolist() if sampled.topk_token_ids is not None else None
    top_lp = sampled.topk_logprobs.tolist() if sampled.topk_logprobs is not None else None
    out = []
    for i in rows:
        d = {token_ids[i]: lp[i]}
        n = num_logprobs[i]
        if n and top_ids is not None and top_lp is not None:
            for t, v in zip(top_ids[i][:n], top_lp[i][:n]):
                d.setdefault(t, v)
        out.append(d)
    return out


def _run_logprob_lists(
    req_ids: list[str],
    drafts: list[list[int]],
    emitted: list[list[int]],
    num_logprobs: list[int],
    raw_logprobs: torch.Tensor,
) -> dict[str, list[dict[int, float]]]:
    """One ``{token: logprob}`` per emitted token of each speculating request that
    asked (``raw_logprobs``: a row per verified position, each request's ``1 + k``
    in turn): token ``j`` of a run reads row ``j`` of it, the logits a plain decode
    of that token would have sampled from."""
    rows: list[int] = []
    tokens: list[int] = []
    start = 0
    for d, toks in zip(drafts, emitted):
        if num_logprobs[start] >= 0:
            rows.extend(range(start, start + len(toks)))
            tokens.extend(toks)
        start += len(d) + 1
    if not rows:
        return {}
    sel = raw_logprobs.index_select(0, torch.tensor(rows, device=raw_logprobs.device))
    token_t = torch.tensor(tokens, device=sel.device)
    n = max(num_logprobs[r] for r in rows)
    sampled = SamplerOutput(token_t, sel.gather(1, token_t.unsqueeze(1)).squeeze(1))
    if n > 0:
        sampled.topk_logprobs, sampled.topk_token_ids = sel.topk(n, dim=-1)
    entries = _logprob_entries(list(range(len(rows))), tokens, [num_logprobs[r] for r in rows], sampled)
    out: dict[str, list[dict[int, float]]] = {}
    start, i = 0, 0
    for req_id, d, toks in zip(req_ids, drafts, emitted):
        if num_logprobs[start] >= 0:
            out[req_id] = entries[i : i + len(toks)]
            i += len(toks)
        start += len(d) + 1
    return out
