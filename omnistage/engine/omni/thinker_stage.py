"""The thinker stage: an ``LLMEngine`` whose runner keeps the talker's per-token rows."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from omnistage.engine.arg_utils import EngineArgs
from omnistage.engine.llm_engine import LLMEngine, PromptType
from omnistage.models.loader import LoadedModel
from omnistage.models.qwen2_5_omni_talker import ThinkerOutputForTalker
from omnistage.multimodal.inputs import MultiModalFeatureSpec
from omnistage.outputs import RequestOutput
from omnistage.sampling_params import SamplingParams
from omnistage.worker.omni.thinker_runner import ThinkerStageRunner

__all__ = ["ThinkerResult", "ThinkerStage"]


@dataclass
class ThinkerResult:
    """A finished thinker request, and its hand-off when the talker should speak it.

    ``handoff`` is None when the request did not ask for audio, or when it
    produced fewer than 2 tokens (the talker has nothing to condition on).
    """

    output: RequestOutput
    handoff: ThinkerOutputForTalker | None


class ThinkerStage:
    """The thinker as a pipeline stage. It has a scheduler and KV pool of its own,
    batches continuously, and hands each finished request on at once.

    It is an ``LLMEngine`` (prompt processing, children, stop strings,
    detokenizing) running a ``ThinkerStageRunner``.
    """

    def __init__(self, args: EngineArgs, loaded_model: LoadedModel, enable_tensor_cache: bool = True) -> None:
        # Build the tensor cache only where a hit can happen: without KV prefix caching
        # every token is forwarded, and every row comes from the step itself.
        self.enable_tensor_cache = enable_tensor_cache and args.enable_prefix_caching
        factory = functools.partial(ThinkerStageRunner, enable_tensor_cache=self.enable_tensor_cache)
        self.engine = LLMEngine(args, loaded_model=loaded_model, runner_factory=factory)
        self.runner: ThinkerStageRunner = self.engine.runner  # type: ignore[assignment]
        if not isinstance(self.runner, ThinkerStageRunner):
            raise RuntimeError(f"the thinker engine runs a {type(self.runner).__name__}, expected a ThinkerStageRunner")
        self._feeds_talker: dict[str, dict[str, Any]] = {}  # request id -> grid fields of its prompt
        # The last step's outputs of requests still generating (cumulative, as
        # LLMEngine gives them): what a server streams while the thinker talks.
        self.progress: list[RequestOutput] = []

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams, feeds_talker: bool
    ) -> None:
        if feeds_talker and params.n != 1:
            raise ValueError(f"request {request_id!r}: audio output supports n=1 only, got n={params.n}")
        inputs = self.engine.process_inputs(request_id, prompt)
        self.engine.add_request(request_id, inputs, params)
        if feeds_talker:
            # The talker's M-RoPE positions need the prompt's grids and audio lengths.
            self._feeds_talker[request_id] = _grid_fields(inputs.mm_features)
            self.runner.collect_states(request_id)  # n == 1: the child id is the request id

    def abort_request(self, request_ids: Iterable[str]) -> None:
        ids = list(request_ids)
        self.engine.abort_request(ids)
        self.runner.forget(ids)  # also for ids whose engine request already finished
        for rid in ids:
            self._feeds_talker.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        # Rows the runner still holds (finished or aborted requests) are dropped, and
        # their deferred rows committed or discarded, at its next step: take it.
        return self.engine.has_unfinished_requests() or self.runner.input_batch.num_reqs > 0

    def held(self) -> dict[str, int]:
        """What the stage still holds for requests: all zero once every request ended
        (cached KV blocks and encoder outputs no request references do not count)."""
        scheduler, runner = self.engine.scheduler, self.runner
        encoder = getattr(scheduler, "encoder_cache_manager", None)
        cache = runner.tensor_cache
        worker_encoder = getattr(runner, "encoder_cache", None)
        return {
            "thinker_requests": scheduler.get_num_unfinished_requests() + len(self._feeds_talker),
            "thinker_kv_blocks": scheduler.kv_cache_manager.num_used_blocks,
            "thinker_batch_rows": runner.input_batch.num_reqs,
            "thinker_collected_rows": runner.num_collecting,
            "thinker_staged_tensors": 0 if cache is None else cache.num_staged_requests,
            "thinker_encoder_refs": 0 if encoder is None else encoder.num_referenced_entries,
            "thinker_encoder_requests": 0 if worker_encoder is None else len(worker_encoder.mm_features),
        }

    def step(self) -> list[ThinkerResult]:
        """The requests finished this step; the others' outputs go to ``progress``."""
        results = []
        self.progress = []
        for out in self.engine.step():
            if out.finished:
                results.append(ThinkerResult(out, self._handoff(out)))
            else:
                self.progress.append(out)
        return results

    def _handoff(self, out: RequestOutput) -> ThinkerOutputForTalker | None:
        rid = out.request_id
        grids = self._feeds_talker.pop(rid, None)
        if grids is None:
            return None
        states = self.runner.pop_states(rid)
        completion = out.outputs[0]
        prompt_ids, output_ids = list(out.prompt_token_ids), list(completion.token_ids)
        if len(output_ids) < 2:
            return None
        expected = len(prompt_ids) + len(output_ids) - 1
        got = 0 if states is None else states.shape[0]
        if got != expected:
            # A prefix hit without its cached rows (or a lost step) would give the
            # talker a truncated conditioning: never hand that on silently.
            raise RuntimeError(
                f"thinker request {rid!r}: collected {got} per-token rows for the talker, expected "
                f"{expected} (prompt {len(prompt_ids)} + generated {len(output_ids)} - 1); "
                f"tensor prefix cache {'on' if self.enable_tensor_cache else 'off'}"
            )
        return ThinkerOutputForTalker(rid, prompt_ids, output_ids, states, **grids)


def _grid_fields(features: list[MultiModalFeatureSpec]) -> dict[str, Any]:
    """``ThinkerOutputForTalker``'s grid fields, gathered as the thinker adapter does for its positions."""

    def gather(modality: str, key: str) -> torch.Tensor | None:
        values = [f.data[key] for f in features if f.modality == modality and f.data is not None]
        return torch.cat(values) if values else None

    return {
        "image_grid_thw": gather("image", "image_grid_thw"),
        "video_grid_thw": gather("video", "video_grid_thw"),
        "audio_seqlens": gather("audio", "audio_feature_lengths"),
        "second_per_grids": gather("video", "second_per_grid_ts"),
    }
