"""The synchronous engine: requests in, one scheduled step at a time, outputs out.

``LLMEngine`` is thread-confined: ``add_request``, ``abort_request`` and
``step`` must all be called from one thread (the offline ``LLM`` calls them
inline; the OpenAI server queues them onto its engine thread).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from omnistage.core.config import SchedulerConfig
from omnistage.core.encoder_cache_manager import compute_mm_encoder_budget
from omnistage.core.request import Request, RequestStatus
from omnistage.core.scheduler import Scheduler
from omnistage.engine.arg_utils import EngineArgs
from omnistage.engine.input_processor import InputProcessor, ProcessedInputs, PromptType
from omnistage.engine.output_processor import OutputProcessor
from omnistage.outputs import RequestOutput
from omnistage.sampling_params import SamplingParams
from omnistage.worker.host_memory import keep_freed_host_memory
from omnistage.worker.kv_cache import kv_cache_bytes_per_block
from omnistage.worker.model_runner import ModelRunner

__all__ = ["EngineStats", "LLMEngine", "ProcessedInputs", "PromptType"]


@dataclass
class EngineStats:
    """A snapshot of the engine's load and of the prefix cache's usefulness."""

    num_running_reqs: int
    num_waiting_reqs: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_cache_query_tokens: int
    prefix_cache_hit_tokens: int
    num_generated_tokens: int
    num_preemptions: int
    num_steps: int

    @property
    def prefix_cache_hit_rate(self) -> float:
        q = self.prefix_cache_query_tokens
        return self.prefix_cache_hit_tokens / q if q else 0.0

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


class LLMEngine:
    """Scheduler + model runner + output processing for one model.

    A multimodal checkpoint (Qwen2.5-VL, Qwen2.5-Omni thinker) also gets its
    ``MultiModalProcessor`` (prompts with ``multi_modal_data``) and an
    encoder budget sized from the largest item the model accepts;
    ``input_modalities`` says what it takes.
    """

    def __init__(
        self,
        args: EngineArgs,
        loaded_model: Any | None = None,
        runner_factory: Callable[..., ModelRunner] = ModelRunner,
    ) -> None:
        keep_freed_host_memory()  # per-step buffers reuse freed memory instead of faulting in new pages
        if loaded_model is None:
            from omnistage.models.loader import load_model

            loaded_model = load_model(args.model, dtype=args.dtype, device=args.device)
        self.args = args
        loaded_model.tokenizer = args.customize_tokenizer(loaded_model.tokenizer)  # --tokenizer, --chat-template
        self.loaded_model = loaded_model
        self.tokenizer = loaded_model.tokenizer
        model = loaded_model.model
        self.vocab_size = model.vocab_size
        self.eos_token_ids = list(loaded_model.eos_token_ids or [])
        self.max_model_len = args.resolve_max_model_len(loaded_model.max_model_len)
        per_block = kv_cache_bytes_per_block(
            model.num_layers, args.block_size, model.num_kv_heads, model.head_dim, model.dtype
        )
        self.num_kv_blocks = args.resolve_num_kv_blocks(per_block, self.max_model_len)
        mm_processor = None
        encoder_budget, encoder_cache_size = 0, 0
        if getattr(loaded_model, "mm_adapter", None) is not None:
            from omnistage.multimodal.processing import MultiModalProcessor

            mm_processor = MultiModalProcessor.from_pretrained(loaded_model.model_path, tokenizer=self.tokenizer)
            encoder_budget, encoder_cache_size = compute_mm_encoder_budget(
                args.max_num_batched_tokens,
                mm_processor.max_tokens_per_item(),
                args.max_num_batched_encoder_embeds,
                args.encoder_cache_size,
            )
        self.input_processor = InputProcessor(self.tokenizer, self.vocab_size, self.max_model_len, mm_processor)
        self.input_modalities = self.input_processor.input_modalities
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                block_size=args.block_size,
                num_kv_blocks=self.num_kv_blocks,
                enable_prefix_caching=args.enable_prefix_caching,
                encoder_compute_budget=encoder_budget,
                encoder_cache_size=encoder_cache_size,
                retain_encoder_outputs=args.enable_encoder_cache,
            )
        )
        self.runner = runner_factory(
            loaded_model,
            block_size=args.block_size,
            num_kv_blocks=self.num_kv_blocks,
            max_num_seqs=args.max_num_seqs,
            max_model_len=self.max_model_len,
            device=args.device,
            seed=args.seed,
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.num_steps = 0
        self.num_generated_tokens = 0

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args)

    # -- requests ------------------------------------------------------------

    def process_inputs(self, request_id: str, prompt: PromptType | ProcessedInputs) -> ProcessedInputs:
        """Tokenize a prompt and process its media, touching no engine state
        (``LLM`` processes a whole batch before queuing any of it). Items that
        could never be encoded (larger than the encoder cache) are refused here."""
        inputs = self.input_processor.process(request_id, prompt)
        self.scheduler.check_mm_items(request_id, inputs.mm_features)
        return inputs

    def add_request(
        self,
        request_id: str,
        prompt: PromptType | ProcessedInputs,
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request. Raises ``ValueError`` naming the request (and the
        item, for bad media) when the prompt or the parameters are unusable;
        nothing is queued then."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request id must be a non-empty string, got {request_id!r}")
        if request_id in self.output_processor:
            raise ValueError(f"request {request_id!r}: a request with this id is already running")
        params = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            raise ValueError(
                f"request {request_id!r}: sampling_params must be SamplingParams, got {type(params).__name__}"
            )
        if params.logprobs is not None and params.logprobs > self.vocab_size:
            raise ValueError(
                f"request {request_id!r}: logprobs={params.logprobs} exceeds the vocabulary size {self.vocab_size}"
            )
        inputs = self.process_inputs(request_id, prompt)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        children = [
            Request(
                request_id=request_id if params.n == 1 else f"{request_id}#{i}",
                prompt_token_ids=inputs.prompt_token_ids,
                sampling_params=self._child_params(params, i),
                eos_token_id=self.eos_token_ids[0] if self.eos_token_ids else None,
                max_model_len=self.max_model_len,
                mm_features=inputs.mm_features,
                cache_salt=inputs.cache_salt,
                arrival_time=arrival,
            )
            for i in range(params.n)
        ]
        for child in children:
            if child.request_id in self.output_processor:
                raise ValueError(f"request {request_id!r}: child id {child.request_id!r} is already in use")
        added: list[str] = []
        try:
            for child in children:
                self.scheduler.add_request(child)  # its ValueError names the request
                added.append(child.request_id)
        except ValueError:
            self.scheduler.abort_requests(added)
            raise
        self.output_processor.add_request(request_id, inputs.prompt_text, children, arrival)

    def _child_params(self, params: SamplingParams, index: int) -> SamplingParams:
        """Per-child copy: ``n=1``, seed ``seed + index``, and the model's
        extra EOS ids (beyond the primary one) as stop tokens."""
        changes: dict[str, Any] = {"n": 1}
        if params.seed is not None:
            changes["seed"] = params.seed + index
        extra_eos = [t for t in self.eos_token_ids[1:] if t not in params.stop_token_ids]
        if extra_eos and not params.ignore_eos:
            changes["stop_token_ids"] = list(params.stop_token_ids) + extra_eos
        return dataclasses.replace(params, **changes)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Stop requests (by the ids given to ``add_request``); unknown ids are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        children = [cid for rid in ids for cid in self.output_processor.pop_request(rid)]
        if children:
            self.scheduler.abort_requests(children)
            self.runner.forget(children)

    # -- the loop ------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, and return the outputs that changed."""
        sched_out = self.scheduler.schedule()
        runner_out = self.runner.execute_model(sched_out)
        updated = self.scheduler.update_from_output(sched_out, runner_out)
        outputs, stopped = self.output_processor.process(updated, runner_out, time.monotonic())
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        self.num_steps += 1
        self.num_generated_tokens += len(runner_out.sampled_token_ids)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.states)

    def get_stats(self) -> EngineStats:
        s = self.scheduler.get_stats()
        return EngineStats(
            num_running_reqs=s.num_running,
            num_waiting_reqs=s.num_waiting,
            kv_blocks_used=s.kv_blocks_used,
            kv_blocks_total=s.kv_blocks_total,
            prefix_cache_query_tokens=s.prefix_cache_query_tokens,
            prefix_cache_hit_tokens=s.prefix_cache_hit_tokens,
            num_generated_tokens=self.num_generated_tokens,
            num_preemptions=s.num_preemptions,
            num_steps=self.num_steps,
        )

    # -- text helpers ----------------------------------------------------------

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render a conversation (text content only) with the checkpoint's chat template."""
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(f"the tokenizer of {self.loaded_model.name!r} has no chat template")
        return self.input_processor.render_chat(messages, add_generation_prompt, **kwargs)

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        mm_processor_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """A chat prompt ready for ``add_request``: the rendered text, its
        token ids (the template already holds any BOS, so none is added) and,
        for OpenAI-style media parts (``image_url``, ``input_audio``, ...),
        ``multi_modal_data`` (see ``multimodal.chat``)."""
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(f"the tokenizer of {self.loaded_model.name!r} has no chat template")
        return self.input_processor.chat_prompt(messages, add_generation_prompt, mm_processor_kwargs, **kwargs)
