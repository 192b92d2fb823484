"""The scheduler's view of one request."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from omnistage.core.spec_policy import DraftState
from omnistage.multimodal.inputs import MultiModalFeatureSpec
from omnistage.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = enum.auto()  # max_tokens or the model's context length
    FINISHED_ABORTED = enum.auto()

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASON.get(self)


_FINISHED = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}
_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False)  # identity, not field equality: ids are unique
class Request:
    """Token ids, progress and stop rules of one request.

    ``num_computed_tokens`` counts tokens whose KV is in the cache (prefix
    hits included); the tokens in ``[num_computed_tokens, num_tokens)`` are
    still to be fed to the model.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    max_model_len: int | None = None
    mm_features: list[MultiModalFeatureSpec] = field(default_factory=list)
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    # What the model needs of this request besides token ids (a stage's hand-off,
    # e.g. the talker's prompt rows); opaque here, it travels to the worker.
    payload: Any = None
    # The worker returns this request's per-token outputs (for a later stage) each step.
    return_hidden_states: bool = False

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens hit in the prefix cache at first schedule; -1 = not yet
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    # SHA-256 of each full block of ``all_token_ids`` (chained, see
    # ``core.kv_cache_utils``); extended by the scheduler as blocks fill up.
    block_hashes: list[bytes] = field(default_factory=list)
    first_scheduled_time: float | None = None  # time.monotonic() at first schedule, for TTFT / queueing metrics
    # Draft tokens scheduled for verification this step (speculative decoding). Never
    # part of ``all_token_ids`` or the block hashes: only verified tokens are.
    spec_token_ids: list[int] = field(default_factory=list)
    # A worker drafter's (EAGLE) proposal for the tokens after the last one, from
    # the last step; scheduled (cut to what fits) as next step's drafts.
    draft_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0  # drafts verified so far
    num_accepted_tokens: int = 0  # of which accepted
    num_drafts: int = 0  # steps that verified drafts
    # Acceptance record the draft policy sizes this request's drafts by (core/spec_policy.py).
    draft_state: DraftState = field(default_factory=DraftState)

    def __post_init__(self) -> None:
        self.all_token_ids: list[int] = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def finished(self) -> bool:
        return self.status.finished

    def _is_eos(self, token: int) -> bool:
        return not self.sampling_params.ignore_eos and self.eos_token_id is not None and token == self.eos_token_id

    def is_stop_token(self, token: int) -> bool:
        """Whether ``token`` stops this request (EOS unless ignored, or a stop token id),
        ``min_tokens`` aside."""
        return self._is_eos(token) or token in self.sampling_params.stop_token_ids

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """The finished status the last output token calls for, or None.

        Stop tokens come first (a model that chose to stop reports "stop" even
        on its last allowed token) and only once ``min_tokens`` are out; then
        the length limits. Sets ``stop_reason`` for a stop token id.
        """
        sp = self.sampling_params
        token = self.output_token_ids[-1]
        if self.num_output_tokens >= sp.min_tokens:
            if self._is_eos(token):
                return RequestStatus.FINISHED_STOPPED
            if token in sp.stop_token_ids:
                self.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        if sp.max_tokens is not None and self.num_output_tokens >= sp.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
