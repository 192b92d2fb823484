"""The runner of a one-shot stage: each scheduled request through the model once."""

from __future__ import annotations

from typing import Any

import torch

from omnistage.core.runner_output import ModelRunnerOutput
from omnistage.core.sched_output import SchedulerOutput

__all__ = ["OneShotRunner"]


class OneShotRunner:
    """``ModelRunner``'s interface for a model with no KV cache (a vocoder).

    The model is called once per scheduled request, on that request's
    payload, and returns ``{key: array}``; the outputs come back in
    ``ModelRunnerOutput.multimodal_outputs``. Requests run one at a time,
    never padded into one batch: a model whose attention is block-local
    (Qwen2.5-Omni's token2wav DiT) would give other results padded.
    """

    def __init__(self, model: Any) -> None:
        self.model = model

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        outputs = {new.req_id: self.model(new.payload) for new in so.scheduled_new_reqs}
        return ModelRunnerOutput(req_ids=list(outputs), multimodal_outputs=outputs)

    def forget(self, req_ids: list[str]) -> None:
        """Nothing is kept per request between steps."""

    @property
    def num_rows(self) -> int:
        return 0

    @property
    def num_payloads(self) -> int:
        return 0
