"""What configures a stage engine, and what a stage still holds.

Every stage of a pipeline (and a plain text or vision-language model, which
is a pipeline of one stage) is a ``StageEngine`` configured by a
``StageSpec``. The spec says how the stage runs, not what it computes: the
model declares that (``omnistage.models.interface``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal, Protocol

__all__ = ["StageHeld", "StageInputProcessor", "StageSpec"]


class StageInputProcessor(Protocol):
    """Turns what a stage consumes (a prompt, or the previous stage's hand-off
    record) into ``ProcessedInputs``: token ids for the scheduler, plus the
    per-request payload the model builds its inputs from. Raises ValueError
    naming the request when the input is unusable; touches no engine state."""

    def process(self, request_id: str, prompt: Any) -> Any: ...


@dataclass(frozen=True)
class StageSpec:
    """How one stage runs.

    - ``name``: the stage's name in a pipeline ("thinker", "talker", ...).
    - ``kind``: ``"autoregressive"`` runs the paged scheduler and the model
      runner (KV cache, continuous batching, sampling); ``"chunked"`` runs a ``ChunkedVocoder`` on chunks of each request's codes
      as ``StageEngine.extend_request`` brings them, one chunk per request and
      up to ``max_requests_per_step`` requests per step (a vocoder: no KV, no
      sampling; a whole decode is a one-chunk schedule).
    - ``input_processor``: what the stage consumes; None takes prompts
      (text, token ids, dicts with media) through the model's tokenizer and
      media processor.
    - ``enable_prefix_caching``: False turns the KV prefix cache off for this
      stage whatever the engine arguments say (a stage whose token ids do not
      identify what the tokens hold, like the talker's).
    - ``enable_tensor_cache``: keep the per-token tensors the model declares
      beside the KV blocks, so that prefix hits still return every row.
    """

    name: str = "llm"
    kind: Literal["autoregressive", "chunked"] = "autoregressive"
    input_processor: StageInputProcessor | None = None
    enable_prefix_caching: bool = True
    enable_tensor_cache: bool = True
    max_requests_per_step: int = 1

    def __post_init__(self) -> None:
        if self.kind not in ("autoregressive", "chunked"):
            raise ValueError(f"StageSpec.kind must be 'autoregressive' or 'chunked', got {self.kind!r}")
        if self.max_requests_per_step < 1:
            raise ValueError(f"StageSpec.max_requests_per_step must be >= 1, got {self.max_requests_per_step}")


@dataclass
class StageHeld:
    """What a stage still holds for requests; all zero once every request ended
    (and the stage stepped once more to drop their batch rows). Cached KV blocks
    and encoder outputs that no request references do not count."""

    requests: int = 0  # queued or running, in the scheduler or the output state
    kv_blocks: int = 0
    batch_rows: int = 0
    payloads: int = 0  # per-request payloads and per-token flags in the runner
    staged_tensors: int = 0  # deferred tensor-cache outputs not yet committed
    encoder_refs: int = 0  # encoder-cache entries some request references
    encoder_requests: int = 0  # requests registered with the worker's encoder cache
    parked_generators: int = 0  # random streams of preempted seeded requests, kept for their resume
    remote_encoder_outputs: int = 0  # encoder-worker outputs the stage still references (EPD)
    drafter_kept: int = 0  # EAGLE: requests whose kept target rows still owe a head pass

    @property
    def is_empty(self) -> bool:
        return not any(getattr(self, f.name) for f in fields(self))
