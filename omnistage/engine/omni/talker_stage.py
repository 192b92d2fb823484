"""The talker stage: codec tokens for finished thinker requests, on a paged engine of its own."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from omnistage.core.config import SchedulerConfig
from omnistage.core.request import Request, RequestStatus
from omnistage.core.scheduler import Scheduler
from omnistage.engine.omni.stage_io import TalkerRequest, Token2WavRequest, talker_sampling_defaults
from omnistage.models.qwen2_5_omni_talker import Qwen2_5OmniTalker
from omnistage.sampling_params import SamplingParams
from omnistage.attention.kv_cache import kv_cache_bytes_per_block
from omnistage.models.qwen2_5_omni import PagedOmniTalker
from omnistage.worker.omni.talker_runner import TalkerSequence, TalkerStageRunner

__all__ = ["TalkerParams", "TalkerStage", "TalkerStageConfig"]


@dataclass(frozen=True)
class TalkerParams:
    """How the talker picks codes; the defaults are transformers' ``generate()`` defaults.

    ``temperature=0`` is greedy (``talker_do_sample=False``).
    """

    temperature: float = 0.9
    top_k: int = 40
    top_p: float = 0.8
    repetition_penalty: float = 1.05
    max_tokens: int = 4096
    stop_token_ids: tuple[int, ...] = ()
    suppress_token_ids: tuple[int, ...] = ()

    @classmethod
    def defaults(cls, talker_config: Any, **overrides: Any) -> TalkerParams:
        base = talker_sampling_defaults(talker_config)
        base["stop_token_ids"] = tuple(base["stop_token_ids"])
        base["suppress_token_ids"] = tuple(base["suppress_token_ids"])
        unknown = set(overrides) - set(base)
        if unknown:
            raise ValueError(f"unknown talker parameters {sorted(unknown)}; expected some of {sorted(base)}")
        for key in ("stop_token_ids", "suppress_token_ids"):
            if key in overrides:
                overrides[key] = tuple(overrides[key])
        params = cls(**{**base, **overrides})
        if params.repetition_penalty <= 0:
            raise ValueError(f"talker repetition_penalty must be > 0, got {params.repetition_penalty}")
        return params


@dataclass
class TalkerStageConfig:
    """The talker engine's limits. Its KV prefix caching is always off: its token ids
    (``[codec_mask] * P + ...``) do not identify what the tokens hold."""

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int = 256 * 1024**2
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    device: str = "cpu"
    seed: int = 0
    match_transformers_unpadded: bool = False


@dataclass
class _TalkerLoader:
    """What ``ModelRunner`` reads of a loaded model."""

    model: PagedOmniTalker
    eos_token_ids: list[int] = field(default_factory=list)  # stops come from TalkerParams


class TalkerStage:
    """Takes ``TalkerRequest``s and returns ``Token2WavRequest``s as each finishes.

    Each request's prefill rows, reply rows and positions are built once, on
    add (``Qwen2_5OmniTalker.prepare``), and kept by the runner until the
    request finishes or is aborted. The stop code (codec pad or codec end) is
    not part of the codes handed on.
    """

    def __init__(self, talker_module: Any, text_rows: dict, paged: PagedOmniTalker, config: TalkerStageConfig) -> None:
        self.config = config
        self.prep = Qwen2_5OmniTalker(talker_module, text_rows, config.match_transformers_unpadded)
        num_blocks = config.num_kv_blocks
        if num_blocks is None:
            per_block = kv_cache_bytes_per_block(
                paged.num_layers, config.block_size, paged.num_kv_heads, paged.head_dim, paged.dtype
            )
            max_blocks = config.max_num_seqs * -(-config.max_model_len // config.block_size)
            num_blocks = max(1, min(config.kv_cache_memory_bytes // per_block, max_blocks))
        self.num_kv_blocks = num_blocks
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=config.max_model_len,
                block_size=config.block_size,
                num_kv_blocks=num_blocks,
                enable_prefix_caching=False,
            )
        )
        self.runner = TalkerStageRunner(
            _TalkerLoader(paged),
            block_size=config.block_size,
            num_kv_blocks=num_blocks,
            max_num_seqs=config.max_num_seqs,
            max_model_len=config.max_model_len,
            device=config.device,
            seed=config.seed,
        )
        self._requests: dict[str, tuple[str, int]] = {}  # id -> (speaker, seed)

    def add_request(self, request: TalkerRequest, params: TalkerParams) -> None:
        rid = request.request_id
        prompt = self.prep.prepare(request.handoff, request.speaker_bos_token_id)
        room = self.config.max_model_len - prompt.num_prompt_tokens
        if room < 1:
            raise ValueError(
                f"talker request {rid!r}: its prompt of {prompt.num_prompt_tokens} rows leaves no room in the "
                f"talker's max_model_len={self.config.max_model_len}"
            )
        sampling = SamplingParams(
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            max_tokens=min(params.max_tokens, request.max_codes, room),
            stop_token_ids=list(params.stop_token_ids),
            seed=request.seed,
        )
        self.scheduler.add_request(
            Request(rid, list(prompt.prompt_codec_ids), sampling, max_model_len=self.config.max_model_len)
        )
        self.runner.add_sequence(rid, TalkerSequence(prompt, params.repetition_penalty, params.suppress_token_ids))
        # The hand-off's tensors now live in the prompt; keep only what token2wav needs.
        self._requests[rid] = (request.speaker, request.seed)

    def abort_request(self, request_ids: Iterable[str]) -> None:
        ids = [rid for rid in request_ids if rid in self._requests]
        if ids:
            self.scheduler.abort_requests(ids)
            self.runner.forget(ids)
            for rid in ids:
                del self._requests[rid]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self.runner.input_batch.num_reqs > 0

    def held(self) -> dict[str, int]:
        """What the stage still holds for requests: all zero once every request ended."""
        return {
            "talker_requests": len(self._requests) + self.scheduler.get_num_unfinished_requests(),
            "talker_kv_blocks": self.scheduler.kv_cache_manager.num_used_blocks,
            "talker_batch_rows": self.runner.input_batch.num_reqs,
            "talker_sequences": self.runner.num_sequences,
        }

    def step(self) -> list[Token2WavRequest]:
        so = self.scheduler.schedule()
        out = self.runner.execute_model(so)
        done: list[Token2WavRequest] = []
        for request in self.scheduler.update_from_output(so, out):
            if not request.finished:
                continue
            rid = request.request_id
            self.runner.release([rid])
            speaker, seed = self._requests.pop(rid)
            codes = list(request.output_token_ids)
            stops = request.sampling_params.stop_token_ids
            if request.status is RequestStatus.FINISHED_STOPPED and codes and codes[-1] in stops:
                codes.pop()  # the stop code is not audio
            done.append(Token2WavRequest(rid, codes, speaker, seed))
        return done
