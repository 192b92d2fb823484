"""The stage engine: requests in, one scheduled step at a time, outputs out.

Every stage runs on it: a text or vision-language model is one stage, an
omni pipeline's thinker, talker and vocoder are three (``engine.omni``), each
configured by a ``StageSpec``. The step loop is the same for all of them:
schedule, run the model, update the requests, turn them into outputs.

``StageEngine`` is thread-confined: ``add_request``, ``abort_request`` and
``step`` must all be called from one thread (the offline ``LLM`` calls them
inline; the OpenAI server queues them onto its engine thread).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from omnistage import envs
from omnistage.attention.kv_cache import kv_cache_bytes_per_block
from omnistage.core.config import SchedulerConfig
from omnistage.core.encoder_cache_manager import compute_mm_encoder_budget
from omnistage.core.chunked_scheduler import ChunkedScheduler
from omnistage.core.request import Request
from omnistage.core.scheduler import Scheduler
from omnistage.core.spec_decode import SpeculativeConfig
from omnistage.engine.arg_utils import EngineArgs
from omnistage.engine.detokenizer import word_piece_ids
from omnistage.engine.input_processor import InputProcessor, ProcessedInputs, PromptType
from omnistage.engine.output_processor import OutputProcessor
from omnistage.engine.stage import StageHeld, StageSpec
from omnistage.models.interface import tensor_cache_policy_of
from omnistage.outputs import RequestOutput
from omnistage.sampling_params import SamplingParams
from omnistage.worker.host_memory import keep_freed_host_memory
from omnistage.worker.model_runner import ModelRunner
from omnistage.worker.chunked_runner import ChunkedRunner
from omnistage.worker.step_costs import measure_step_costs

if TYPE_CHECKING:
    from omnistage.worker.mm.remote_encoder import RemoteEncoderPool

__all__ = ["EngineStats", "LLMEngine", "ProcessedInputs", "PromptType", "StageEngine"]

logger = logging.getLogger(__name__)


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
    # Speculative decoding (0 when it is off): drafts verified, and of which accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_drafts: int = 0  # verify runs
    num_accepted_tokens_per_pos: tuple[int, ...] = ()  # accepted drafts by position in their run
    encoder_cache_queries: int = 0  # multimodal items a window needed (0 for a text model)
    encoder_cache_hits: int = 0  # of which the encoder cache held already

    @property
    def draft_acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    @property
    def prefix_cache_hit_rate(self) -> float:
        q = self.prefix_cache_query_tokens
        return self.prefix_cache_hit_tokens / q if q else 0.0

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


class StageEngine:
    """Input processing + scheduler + model runner + output processing for one stage.

    An autoregressive stage runs the paged, prefix-cached ``Scheduler`` and
    the ``ModelRunner``; a chunked stage (``StageSpec.kind``, a vocoder) the
    ``ChunkedScheduler`` and ``ChunkedRunner``. A multimodal checkpoint
    (Qwen2.5-VL, Qwen2.5-Omni thinker) also gets its ``MultiModalProcessor``
    (prompts with ``multi_modal_data``) and an encoder budget sized from the
    largest item the model accepts; ``input_modalities`` says what it takes.
    """

    # What a single stage gives; an omni pipeline that speaks also gives audio, in its voices.
    output_modalities: frozenset[str] = frozenset({"text"})
    voices: tuple[str, ...] = ()

    def __init__(self, args: EngineArgs, loaded_model: Any | None = None, spec: StageSpec | None = None) -> None:
        keep_freed_host_memory()  # per-step buffers reuse freed memory instead of faulting in new pages
        if loaded_model is None:
            from omnistage.models.loader import load_model

            loaded_model = load_model(args.model, dtype=args.dtype, device=args.device)
        self.spec = spec = spec or StageSpec()
        self.args = args
        self.loaded_model = loaded_model
        self.tokenizer = loaded_model.tokenizer
        if spec.input_processor is None:  # a stage that takes prompts: --tokenizer, --chat-template
            self.tokenizer = args.customize_tokenizer(self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.num_steps = 0
        self.eos_token_ids = list(getattr(loaded_model, "eos_token_ids", None) or [])
        self.remote_encoder: RemoteEncoderPool | None = None  # encoder workers (EPD), multimodal stages only
        self.scheduler: Scheduler | ChunkedScheduler
        self.runner: ModelRunner | ChunkedRunner
        if spec.kind == "chunked":
            self.vocab_size = self.max_model_len = self.num_kv_blocks = 0
            self.input_processor, self.input_modalities = spec.input_processor, frozenset()
            self.scheduler = ChunkedScheduler(spec.max_requests_per_step)
            self.runner = ChunkedRunner(loaded_model.model)
        else:
            self._build_autoregressive(args, loaded_model, spec)

    def _build_autoregressive(self, args: EngineArgs, loaded_model: Any, spec: StageSpec) -> None:
        """KV pool sized from the arguments, the paged scheduler, the model runner;
        for a stage that takes prompts, their tokenizer and media processor."""
        model = loaded_model.model
        self.vocab_size = model.vocab_size
        self.max_model_len = args.resolve_max_model_len(loaded_model.max_model_len)
        per_block = kv_cache_bytes_per_block(
            model.num_layers, args.block_size, model.num_kv_heads, model.head_dim, model.dtype
        )
        self.num_kv_blocks = args.resolve_num_kv_blocks(per_block, self.max_model_len)
        encoder_budget, encoder_cache_size = 0, 0
        mm_processor = None
        if spec.input_processor is not None:
            self.input_processor, self.input_modalities = spec.input_processor, frozenset()
        else:
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
        prefix_caching = args.enable_prefix_caching and spec.enable_prefix_caching
        speculative_config = self._speculative_config(args, loaded_model, spec, mm_processor)
        drafter = None
        if speculative_config is not None and speculative_config.uses_drafter:
            from omnistage.models.eagle_head import load_eagle_head

            assert speculative_config.model is not None
            lean = getattr(model, "lean", None)  # a head for a GGUF-quantized target is rounded to Q8_0
            drafter = load_eagle_head(
                speculative_config.model, model.hidden_size, model.dtype, args.device,
                int8=lean is not None and lean.group_int8,
            )  # fmt: skip
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                block_size=args.block_size,
                num_kv_blocks=self.num_kv_blocks,
                enable_prefix_caching=prefix_caching,
                encoder_compute_budget=encoder_budget,
                encoder_cache_size=encoder_cache_size,
                retain_encoder_outputs=args.enable_encoder_cache,
                speculative_config=speculative_config,
            )
        )
        self.runner = ModelRunner(
            loaded_model,
            block_size=args.block_size,
            num_kv_blocks=self.num_kv_blocks,
            max_num_seqs=args.max_num_seqs,
            max_model_len=self.max_model_len,
            device=args.device,
            seed=args.seed,
            max_num_batched_tokens=args.max_num_batched_tokens,
            # Only where a hit can happen: without KV prefix caching every token is
            # forwarded, and every row comes from the step itself. Deferred keys are
            # staged and committed whenever the model declares them.
            enable_tensor_cache=spec.enable_tensor_cache
            and (prefix_caching or bool(tensor_cache_policy_of(getattr(loaded_model, "mm_adapter", None) or loaded_model.model).deferred_keys)),
            drafter=drafter,
        )
        if self.scheduler.draft_policy is not None and envs.measure_step_cost_enabled():
            self._measure_step_cost(speculative_config.num_speculative_tokens)
        if args.num_encoder_workers:
            if mm_processor is None:
                if spec.input_processor is None:  # later pipeline stages take hand-off records, never media
                    logger.warning("num_encoder_workers is ignored: %r takes no media", loaded_model.name)
            else:
                from omnistage.worker.mm.remote_encoder import RemoteEncoderPool

                self.remote_encoder = RemoteEncoderPool.for_model(loaded_model, mm_processor, args)
                self.runner.remote_encoder = self.remote_encoder

    def _measure_step_cost(self, max_drafts: int) -> None:
        """Price drafts for the draft policy on this machine (``worker/step_costs.py``), before any request."""
        start = time.perf_counter()
        cost = measure_step_costs(self.runner, max_drafts)
        if cost is None:
            logger.info("speculative decoding: too few KV blocks or tokens to measure step costs; built-in curve kept")
            return
        self.scheduler.draft_policy.step_cost = cost
        logger.info(
            "speculative decoding: step costs measured in %.2f s (cost vs a 1-row decode step): "
            "verify {rows: (tokens, cost)} %s, decode (rows, cost) %s", time.perf_counter() - start,
            {rows: [(t, round(c, 2)) for t, c in curve] for rows, curve in cost.verify_curves.items()},
            [(t, round(c, 2)) for t, c in cost.decode_points],
        )  # fmt: skip

    @staticmethod
    def _speculative_config(
        args: EngineArgs, loaded_model: Any, spec: StageSpec, mm_processor: Any
    ) -> SpeculativeConfig | None:
        """``args.speculative_config`` for the scheduler, with the model's
        placeholder ids (never proposed); refused for stages whose model reads
        more than token ids (payload-driven stages such as the talker: not
        supported yet). Stages that hand per-token outputs on (the thinker)
        speculate: only verified tokens' rows are returned and cached."""
        if args.speculative_config is None:
            return None
        config = SpeculativeConfig.from_dict(args.speculative_config)
        model = loaded_model.model
        if spec.input_processor is not None or hasattr(model, "step_inputs"):
            name = spec.name or type(model).__name__
            raise ValueError(
                f"speculative_config is not supported yet for the {name!r} stage: its model reads a payload "
                "beyond token ids; speculation runs on text, vision-language and omni thinker stages"
            )
        placeholders = getattr(mm_processor, "placeholder_ids", None) or {}
        return config.for_model(placeholders.values(), word_piece_ids(loaded_model.tokenizer))

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> StageEngine:
        return cls(args)

    # -- requests ------------------------------------------------------------

    def process_inputs(
        self, request_id: str, prompt: PromptType | ProcessedInputs, truncate_prompt_tokens: int | None = None
    ) -> ProcessedInputs:
        """Tokenize a prompt and process its media, touching no engine state
        (``LLM`` processes a whole batch before queuing any of it), keeping its
        last tokens when ``truncate_prompt_tokens`` says so. Items that
        could never be encoded (larger than the encoder cache) are refused here.
        Inputs already processed (by this call) pass through unchanged."""
        if isinstance(prompt, ProcessedInputs):
            return prompt
        if self.spec.input_processor is None:  # a stage that takes prompts
            inputs = self.input_processor.process(request_id, prompt, truncate_prompt_tokens)
        else:  # the stage before's hand-off record: its ids are that stage's, never cut
            inputs = self.input_processor.process(request_id, prompt)
        self.scheduler.check_mm_items(request_id, inputs.mm_features)
        return inputs

    def add_request(
        self,
        request_id: str,
        prompt: PromptType | ProcessedInputs,
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
        return_hidden_states: bool = False,
    ) -> None:
        """Queue a request. Raises ``ValueError`` naming the request (and the
        item, for bad media) when the prompt or the parameters are unusable;
        nothing is queued then. ``return_hidden_states`` asks for the model's
        per-token outputs (every forwarded token's row, for a later stage) in
        the finished output's ``multimodal_output["hidden_states"]``; it needs
        ``n == 1``."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request id must be a non-empty string, got {request_id!r}")
        if request_id in self.output_processor:
            raise ValueError(f"request {request_id!r}: a request with this id is already running")
        params = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            raise ValueError(
                f"request {request_id!r}: sampling_params must be SamplingParams, got {type(params).__name__}"
            )
        if self.vocab_size:  # logprobs and allowed ids within the model's vocabulary
            try:
                params.check_vocab(self.vocab_size, self.eos_token_ids)
            except ValueError as exc:
                raise ValueError(f"request {request_id!r}: {exc}") from None
        if return_hidden_states and params.n != 1:
            raise ValueError(f"request {request_id!r}: per-token outputs need n=1, got n={params.n}")
        inputs = self.process_inputs(request_id, prompt, params.truncate_prompt_tokens)
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
                payload=inputs.payload,
                return_hidden_states=return_hidden_states,
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
        if self.remote_encoder is not None and inputs.mm_features:
            # Now, not when the window reaches the items: they are encoded while the batch decodes.
            manager = self.scheduler.encoder_cache_manager
            held = manager if manager is not None else ()
            self.remote_encoder.submit([c.request_id for c in children], inputs.mm_features, held)

    def _child_params(self, params: SamplingParams, index: int) -> SamplingParams:
        """Per-child copy: ``n=1``, seed ``seed + index``, prompt logprobs for the
        first child only, and the model's extra EOS ids (beyond the primary one)
        as stop tokens."""
        changes: dict[str, Any] = {"n": 1}
        if params.seed is not None:
            changes["seed"] = params.seed + index
        if index and params.prompt_logprobs is not None:
            changes["prompt_logprobs"] = None  # the same for every completion: the first computes them
        extra_eos = [t for t in self.eos_token_ids[1:] if t not in params.stop_token_ids]
        if extra_eos and not params.ignore_eos:
            changes["stop_token_ids"] = list(params.stop_token_ids) + extra_eos
        return dataclasses.replace(params, **changes)

    def extend_request(self, request_id: str, codes: list[int], final: bool) -> None:
        """A chunked stage: a running request's inputs so far (they extend the
        ones it was added with, or last extended with); ``final``: no more come.
        Ids that ended (aborted) are ignored."""
        if not isinstance(self.scheduler, ChunkedScheduler):
            raise TypeError(f"stage {self.spec.name!r} is {self.spec.kind!r}; only a chunked stage takes more input")
        self.scheduler.extend_request(request_id, codes, final)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Stop requests (by the ids given to ``add_request``); unknown ids are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self._release([cid for rid in ids for cid in self.output_processor.pop_request(rid)])

    def _release(self, children: list[str]) -> None:
        """Free what ended child requests hold in the scheduler and the runner, and the
        encoder workers' outputs only they were waiting for (no step may come to do it)."""
        if children:
            self.scheduler.abort_requests(children)
            self.runner.forget(children)
            if self.remote_encoder is not None:
                self.remote_encoder.release_ended(self.scheduler.requests)

    # -- the loop ------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, and return the outputs that changed.

        A failure is contained: a request that cannot join the batch fails
        alone, and if the step itself raises, the requests it ran fail (their
        outputs finish with reason "error" and ``error`` set) while every
        other request goes on; what the failed ones held is released.
        """
        remote = self.remote_encoder
        if remote is not None:
            self._sync_remote_encoder(remote)
        sched_out = self.scheduler.schedule()
        if remote is not None and sched_out.is_empty and remote.pending_ids():
            remote.wait(0.05)  # everything waits on a worker: block briefly instead of spinning
        if sched_out.preempted_req_ids:
            self.output_processor.drop_rows(sched_out.preempted_req_ids)
        try:
            runner_out = self.runner.execute_model(sched_out)
        except Exception as exc:  # noqa: BLE001 - contained: only this step's requests fail
            self._forget_unencoded()
            logger.exception("stage %r: a step failed; failing the %d request(s) it ran", self.spec.name,
                             len(sched_out.num_scheduled_tokens))  # fmt: skip
            error = f"the engine step failed ({type(exc).__name__}: {exc})"
            return self._fail(dict.fromkeys(sched_out.num_scheduled_tokens, error))
        self._forget_unencoded()
        failed = self._fail(runner_out.failed_req_ids) if runner_out.failed_req_ids else []
        updated = self.scheduler.update_from_output(sched_out, runner_out)
        outputs, stopped = self.output_processor.process(updated, runner_out, time.monotonic())
        if stopped:
            self.scheduler.finish_stopped(stopped)
        if remote is not None:
            remote.release_ended(self.scheduler.requests)  # what ended releases its published outputs now
        self.num_steps += 1
        return failed + outputs

    def _forget_unencoded(self) -> None:
        """Encoder-cache entries the step was to fill but did not (it failed, or the
        item's request failed to join the batch) are forgotten, so no later request
        takes a hit on an output that does not exist."""
        encoder = getattr(self.scheduler, "encoder", None)  # a chunk stage's scheduler has none
        if encoder is not None and encoder.allocated:
            encoder.forget_unencoded(self.runner.holds_encoder_output)

    def _sync_remote_encoder(self, remote: RemoteEncoderPool) -> None:
        """Before a pass: resolve the workers' finished encodes, release what
        ended requests (aborts included) held, and tell the scheduler which
        items are pending and which are published."""
        remote.poll()
        remote.release_ended(self.scheduler.requests)
        encoder = self.scheduler.encoder
        encoder.remote_pending = remote.pending_ids()
        encoder.remote_ready = remote.ready_ids()

    def _fail(self, errors: dict[str, str]) -> list[RequestOutput]:
        """Fail the user requests of these child ids (with their error) and abort them."""
        outputs, children = [], []
        now = time.monotonic()
        for cid, error in errors.items():
            rid = self.output_processor.parent_of(cid)
            if rid is None:
                continue  # already ended (another child of the same request failed first)
            out, unfinished = self.output_processor.fail_request(rid, f"request {rid!r}: {error}", now)
            outputs.append(out)
            children += unfinished
        self._release(children)
        return outputs

    def has_unfinished_requests(self) -> bool:
        # Rows of requests that ended stay in the runner's batch (with their payloads
        # and staged tensors) until its next step drops them: that step is owed too.
        return self.scheduler.has_unfinished_requests() or self.runner.num_rows > 0

    def held(self) -> StageHeld:
        """What the stage still holds for requests (see ``StageHeld``)."""
        s = self.scheduler.get_stats()
        runner = self.runner
        held = StageHeld(
            requests=self.scheduler.get_num_unfinished_requests() + len(self.output_processor.states),
            kv_blocks=s.kv_blocks_used,
            batch_rows=runner.num_rows,
            payloads=runner.num_payloads,
        )
        if isinstance(runner, ModelRunner):
            held.parked_generators = runner.num_parked_generators
            held.drafter_kept = runner.num_drafter_kept
            if runner.tensor_cache is not None:
                held.staged_tensors = runner.tensor_cache.num_staged_requests
            if runner.encoder_cache is not None:
                held.encoder_requests = len(runner.encoder_cache.mm_features)
            encoder = getattr(self.scheduler, "encoder_cache_manager", None)
            if encoder is not None:
                held.encoder_refs = encoder.num_referenced_entries
            if self.remote_encoder is not None:
                held.remote_encoder_outputs = self.remote_encoder.num_entries
        return held

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
            num_generated_tokens=s.num_output_tokens,
            num_preemptions=s.num_preemptions,
            num_steps=self.num_steps,
            num_draft_tokens=s.num_draft_tokens,
            num_accepted_tokens=s.num_accepted_tokens,
            num_drafts=s.num_drafts,
            num_accepted_tokens_per_pos=s.num_accepted_tokens_per_pos,
            encoder_cache_queries=s.encoder_cache_queries,
            encoder_cache_hits=s.encoder_cache_hits,
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


# vLLM's name for the engine of a single-stage model.
LLMEngine = StageEngine
