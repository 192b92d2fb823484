"""The thinker stage's runner: a ModelRunner that also keeps what the talker reads."""

from __future__ import annotations

from typing import Any

import torch

from omnistage.core.sched_output import SchedulerOutput
from omnistage.models.qwen2_5_omni_talker import thinker_states_for_talker
from omnistage.worker.input_batch import BatchStep
from omnistage.worker.model_runner import ModelRunner
from omnistage.worker.tensor_prefix_cache.step_cache import StepTensorCache
from omnistage.models.interface import tensor_cache_policy_of
from omnistage.core.runner_output import ModelRunnerOutput

__all__ = ["ThinkerStageRunner", "placeholder_token_ids"]


def placeholder_token_ids(hf_config: Any) -> list[int]:
    """Audio, image and video placeholder ids of a Qwen2.5-Omni (thinker) config."""
    cfg = getattr(hf_config, "thinker_config", hf_config)
    names = ("audio_token_index", "image_token_index", "video_token_index")
    return [int(getattr(cfg, n)) for n in names if getattr(cfg, n, None) is not None]


class ThinkerStageRunner(ModelRunner):
    """Runs the thinker and keeps, for each request that feeds the talker, the
    per-token tensor the talker conditions on.

    That tensor is ``final hidden + input embedding``, with the embedding zero
    at multimodal placeholders (``thinker_states_for_talker``). It covers every
    token the thinker forwards: the prompt, then each generated token but the
    last. It is computed from the step's hidden states before sampling, in the
    ``compute_hidden_states`` hook.

    With prefix caching, a new request's hit prefix is never forwarded. The
    tensor prefix cache (``StepTensorCache``) supplies those rows. It is built
    when the model declares a full-prefix tensor and prefix caching is on.
    Otherwise it costs nothing. With ``enable_tensor_cache=False`` and prefix
    caching on, a hit leaves a request short of rows, and the stage raises at
    the hand-off.

    Preemption drops the rows collected so far. The resumed request comes back
    as a new request, and the merge rebuilds its rows from the cache.
    """

    def __init__(
        self,
        loaded_model: Any,
        block_size: int,
        num_kv_blocks: int,
        *args: Any,
        enable_tensor_cache: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(loaded_model, block_size, num_kv_blocks, *args, **kwargs)
        # The declaration sits on the multimodal adapter when there is one, else on the model.
        policy = tensor_cache_policy_of(getattr(loaded_model, "mm_adapter", None) or self.model)
        self.tensor_cache: StepTensorCache | None = None
        if enable_tensor_cache and policy.caches_anything:
            self.tensor_cache = StepTensorCache(
                policy, num_kv_blocks, block_size, self.model.hidden_size, self.model.dtype
            )
        # A model with deferred keys computes them after sampling (``deferred_outputs``).
        self._deferred_source = getattr(loaded_model, "mm_adapter", None) or self.model
        self._placeholders = torch.tensor(placeholder_token_ids(loaded_model.hf_config), device=self.device)
        self._feeds_talker: set[str] = set()  # requests whose per-token rows are collected
        self._rows: dict[str, list[torch.Tensor]] = {}

    # -- what the stage asks -----------------------------------------------------

    def collect_states(self, req_id: str) -> None:
        """Collect ``req_id``'s per-token rows from its first step on."""
        self._feeds_talker.add(req_id)

    def pop_states(self, req_id: str) -> torch.Tensor | None:
        """All rows collected for a request, as one CPU tensor; forgets the request."""
        self._feeds_talker.discard(req_id)
        rows = self._rows.pop(req_id, None)
        if rows is None:
            return None
        return (torch.cat(rows) if len(rows) > 1 else rows[0].clone()).cpu()

    def forget(self, req_ids: list[str]) -> None:
        super().forget(req_ids)
        for req_id in req_ids:
            self._feeds_talker.discard(req_id)
            self._rows.pop(req_id, None)
        if self.tensor_cache is not None:
            self.tensor_cache.discard(req_ids)

    @property
    def num_collecting(self) -> int:
        """Requests whose rows are collected or held (for leak checks)."""
        return len(self._feeds_talker | self._rows.keys())

    # -- hooks into ModelRunner's step ----------------------------------------------

    def _update_states(self, so: SchedulerOutput) -> None:
        if self.tensor_cache is not None:
            self.tensor_cache.begin_step(so, self.input_batch)
        for req_id in so.preempted_req_ids | so.aborted_req_ids:
            self._rows.pop(req_id, None)
        for req_id in so.aborted_req_ids:
            self._feeds_talker.discard(req_id)
        super()._update_states(so)
        if self.tensor_cache is not None:
            self.tensor_cache.rows_added(so)

    def compute_hidden_states(self, step: BatchStep, so: SchedulerOutput) -> torch.Tensor:
        hidden = super().compute_hidden_states(step, so)
        wanted = [i for i, r in enumerate(step.req_ids) if r in self._feeds_talker] if self._feeds_talker else []
        cache = self.tensor_cache
        if cache is not None and not cache.policy.full_prefix_hidden:
            cache = None  # it caches deferred keys only: no rows to write or merge here
        if not wanted and cache is None:
            return hidden  # no request reads rows and none are cached: no extra work
        n = step.num_tokens
        ids = step.input_ids[:n]
        states = thinker_states_for_talker(
            hidden[:n], self.model.embed_input_ids(ids), torch.isin(ids, self._placeholders)
        )
        if states.device.type != "cpu":
            # One device-to-host copy per step, shared by the cache write, the merge and
            # the hand-off (all on the host). TODO: pinned buffer + side stream on GPUs.
            states = states.to("cpu")
        if cache is not None:
            cache.write(step, states)
            per_request = cache.merge(step, self.input_batch, states, wanted) if wanted else {}
        else:
            parts = torch.split_with_sizes(states, step.num_scheduled_tokens.tolist())
            per_request = {step.req_ids[i]: parts[i] for i in wanted}
        for req_id, rows in per_request.items():
            # Views of this step's fresh ``states`` (merged copies on hits): nothing reuses them.
            self._rows.setdefault(req_id, []).append(rows)
        return hidden

    def sample(self, step: BatchStep, hidden: torch.Tensor) -> ModelRunnerOutput:
        out = super().sample(step, hidden)
        cache = self.tensor_cache
        if cache is not None and cache.policy.deferred_keys:
            # Known only now (they depend on the sampled tokens): staged until the
            # request finishes, dropped if it is aborted or preempted first.
            outputs = self._deferred_source.deferred_outputs(step, hidden, out)
            if outputs:
                cache.stage_deferred(step, self.input_batch, outputs)
        return out
