"""What the scheduler tells the worker each step: plain data, no tensors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omnistage.multimodal.inputs import MultiModalFeatureSpec
from omnistage.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the worker has not seen, or one resumed after preemption.

    ``token_ids`` are all known tokens (prompt, then outputs generated before
    a preemption); ``num_prompt_tokens`` tells them apart. A new request with
    ``num_computed_tokens > 0`` starts with a KV prefix-cache hit: its first
    ``num_computed_tokens // block_size`` blocks hold cached contents.
    """

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    mm_features: list[MultiModalFeatureSpec] = field(default_factory=list)
    payload: Any = None  # ``Request.payload``: model inputs beyond token ids, kept by the worker
    return_hidden_states: bool = False  # the worker returns this request's per-token outputs


@dataclass
class ScheduledChunk:
    """One chunk of a streaming request's output, to decode this step (a
    vocoder stage): every input so far (``codes``), the chunk's index, and
    whether it is the last (the inputs are final and this chunk ends them)."""

    req_id: str
    codes: list[int]
    index: int
    last: bool
    payload: Any = None


@dataclass
class CachedRequestData:
    """A running request the worker already holds: only what changed."""

    req_id: str
    new_block_ids: list[int]  # appended to the request's block table
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # req_id -> indices into that request's mm_features whose encoder runs this step.
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    # Requests that left since the last step: finished, aborted or preempted.
    # The worker drops their rows (committing deferred tensor-cache writes of
    # finished ones first, discarding those of aborted and preempted ones).
    finished_req_ids: set[str] = field(default_factory=set)
    aborted_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # Encoder-cache entries evicted by the scheduler; the worker frees them first.
    free_encoder_mm_hashes: list[str] = field(default_factory=list)
    # Speculative decoding: req_id -> the draft tokens scheduled after its last
    # known token (its ``num_scheduled_tokens`` is 1 + len(drafts)); the worker
    # verifies them in this step's forward.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Worker-side drafter (EAGLE): req_id -> how many draft tokens to propose
    # after this step's forward, for requests that sample a token this step.
    draft_token_requests: dict[str, int] = field(default_factory=dict)
    # A chunked stage (a streaming vocoder): the chunks to decode this step.
    scheduled_chunks: list[ScheduledChunk] = field(default_factory=list)
    # Encoder workers (EPD): req_id -> indices into its mm_features whose
    # output a worker published; the runner loads them (encoding any it cannot
    # load) before the gather. Disjoint from scheduled_encoder_inputs.
    remote_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0

    def fresh_block_ids(self, block_size: int) -> list[int]:
        """Blocks given to requests this step that are not prefix hits: what they hold
        belongs to a request that ended, and this step starts writing them anew."""
        ids: list[int] = []
        for new in self.scheduled_new_reqs:
            ids.extend(new.block_ids[new.num_computed_tokens // block_size :])  # hits are whole blocks
        for cached in self.scheduled_cached_reqs:
            ids.extend(cached.new_block_ids)
        return ids
