"""What the worker hands back to the scheduler after a step.

Plain data the scheduler side reads without importing torch: tensors appear
only in annotations (per-token outputs for a downstream stage).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class ModelRunnerOutput:
    # Requests that sampled a token this step (a prefill chunk that does not
    # reach the end of the prompt samples nothing), in batch order.
    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    # Requests that verified drafts this step: every token they emit, in order
    # (the accepted drafts, then the target's own token); ``sampled_token_ids``
    # holds the last of them.
    spec_sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Worker-side drafter (EAGLE): the draft tokens proposed after this step's
    # tokens, for the requests ``SchedulerOutput.draft_token_requests`` named.
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Log-probability of the sampled token, and of the top-k when asked.
    logprobs: dict[str, dict[int, float]] = field(default_factory=dict)
    # Requests that verified drafts and asked for logprobs: one such entry per
    # token of ``spec_sampled_token_ids`` (each from the logits at its position).
    spec_logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)
    # Requests that asked for prompt logprobs and ran prompt positions this step:
    # (index of the prompt token the first entry is for, one entry per prompt token
    # from there on: its logprob, then the top-N at the position before it).
    prompt_logprobs: dict[str, tuple[int, list[dict[int, float]]]] = field(default_factory=dict)
    # Per-request per-token tensors for a downstream stage (prefix rows merged
    # in from the tensor prefix cache on a hit); None when no stage reads them.
    hidden_states: dict[str, torch.Tensor] | None = None
    multimodal_outputs: dict[str, dict[str, object]] | None = None
    # Requests of this step that failed alone (they could not join the batch), with the error.
    failed_req_ids: dict[str, str] = field(default_factory=dict)
