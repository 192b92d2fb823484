"""Offline inference on an omni checkpoint: ``OmniLLM(...).generate(prompts)`` gives text and speech.

``LLM(model=<Qwen2.5-Omni folder>)`` is meant to dispatch here (``is_omni_checkpoint``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omnistage.engine.arg_utils import EngineArgs
from omnistage.engine.llm_engine import PromptType
from omnistage.engine.omni.loader import OmniModel, is_omni_checkpoint, load_qwen2_5_omni
from omnistage.engine.omni.pipeline import OmniPipeline
from omnistage.engine.omni.talker_stage import TalkerParams, TalkerStage, TalkerStageConfig
from omnistage.engine.omni.thinker_stage import ThinkerStage
from omnistage.engine.omni.token2wav_stage import Token2WavStage
from omnistage.multimodal.media import encode_wav, write_wav  # re-exported: callers imported them from here
from omnistage.outputs import RequestOutput
from omnistage.sampling_params import SamplingParams

__all__ = ["OmniLLM", "encode_wav", "is_omni_checkpoint", "write_wav"]

Conversation = list[dict[str, Any]]


class OmniLLM:
    """An omni model's three stages in this process: the thinker answers, the talker
    and token2wav speak the answer.

    ``model`` is a checkpoint folder or an ``OmniModel`` already loaded (engines
    share weights; each owns its KV caches). Other keyword arguments are the
    thinker's ``EngineArgs`` (``seed``, ``enable_prefix_caching``,
    ``max_num_batched_tokens``, ...), plus:

    - ``talker_params``: overrides of the talker's sampling (``TalkerParams``:
      transformers' defaults; ``{"temperature": 0.0}`` is greedy);
    - ``talker_match_transformers_unpadded``: reproduce transformers 5.24's
      single-request talker path (see ``Qwen2_5OmniTalker``);
    - ``enable_tensor_prefix_cache``: keep the thinker's per-token rows beside its
      KV blocks so that prefix hits still give the talker every row. On by
      default; it only exists when prefix caching is on. Turning it off with
      prefix caching on makes a hit raise at the hand-off;
    - ``talker_max_num_seqs``, ``talker_num_kv_blocks``, ``talker_max_model_len``:
      the talker engine's limits;
    - ``token2wav_requests_per_step``: waveforms decoded per pipeline step.
    """

    def __init__(
        self,
        model: str | Path | OmniModel,
        *,
        talker_params: dict[str, Any] | None = None,
        talker_match_transformers_unpadded: bool = False,
        enable_tensor_prefix_cache: bool = True,
        talker_max_num_seqs: int | None = None,
        talker_num_kv_blocks: int | None = None,
        talker_max_model_len: int | None = None,
        token2wav_requests_per_step: int = 1,
        **engine_args: Any,
    ) -> None:
        if isinstance(model, OmniModel):
            omni = model
            engine_args.setdefault("model", omni.thinker.model_path)
        else:
            engine_args["model"] = str(model)
        args = EngineArgs(**engine_args)
        if not isinstance(model, OmniModel):
            omni = load_qwen2_5_omni(model, args.dtype, args.device)
        self.omni = omni
        thinker = ThinkerStage(args, omni.thinker, enable_tensor_prefix_cache)
        talker = token2wav = None
        defaults = None
        if omni.has_audio_output:
            config = omni.talker_module.config
            defaults = TalkerParams.defaults(config, **(talker_params or {}))
            max_len = talker_max_model_len or min(
                int(config.max_position_embeddings), thinker.engine.max_model_len + 2 + defaults.max_tokens
            )
            talker = TalkerStage(
                omni.talker_module,
                omni.talker_text_rows,
                omni.paged_talker,  # type: ignore[arg-type]
                TalkerStageConfig(
                    block_size=args.block_size,
                    num_kv_blocks=talker_num_kv_blocks,
                    max_num_seqs=talker_max_num_seqs or args.max_num_seqs,
                    max_num_batched_tokens=args.max_num_batched_tokens,
                    max_model_len=max_len,
                    device=args.device,
                    seed=args.seed,
                    match_transformers_unpadded=talker_match_transformers_unpadded,
                ),
            )
            token2wav = Token2WavStage(omni.token2wav, token2wav_requests_per_step)  # type: ignore[arg-type]
        self.pipeline = OmniPipeline(thinker, talker, token2wav, omni.speakers, defaults, seed=args.seed)
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.pipeline.thinker.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        return_audio: bool = True,
        speaker: str | None = None,
        talker_params: dict[str, Any] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Answer each prompt; outputs come back in input order.

        ``outputs[0].text`` / ``.token_ids`` are the thinker's answer. With
        ``return_audio`` (default), ``audio`` is the spoken answer as a 1-D
        float32 waveform and ``sample_rate`` its rate. Without it, both are None
        and the talker and token2wav do no work. ``speaker=None`` is the
        checkpoint's default voice (Chelsie). ``sampling_params`` apply to the
        thinker. ``talker_params`` override the talker's for this call.
        """
        prompts = _as_prompt_list(prompts)
        params = _params_per_prompt(sampling_params, len(prompts))
        pipeline = self.pipeline
        per_call = None
        if talker_params and pipeline.default_talker_params is not None:
            per_call = TalkerParams.defaults(
                self.omni.talker_module.config, **{**_as_overrides(pipeline.default_talker_params), **talker_params}
            )
        order: dict[str, int] = {}
        try:
            for i, (prompt, sp) in enumerate(zip(prompts, params)):
                request_id = str(next(self._ids))
                pipeline.add_request(request_id, prompt, sp, return_audio, speaker, per_call)
                order[request_id] = i
            results: list[RequestOutput | None] = [None] * len(prompts)
            while pipeline.has_unfinished_requests():
                for out in pipeline.step():
                    if out.request_id in order:
                        results[order[out.request_id]] = out
        except BaseException:
            pipeline.abort_request(list(order))
            raise
        return [r for r in results if r is not None]

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        return_audio: bool = True,
        speaker: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Answer conversations rendered with the checkpoint's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        engine = self.pipeline.thinker.engine
        prompts = [engine.encode_chat(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params, return_audio, speaker)


def _as_overrides(params: TalkerParams) -> dict[str, Any]:
    return {k: getattr(params, k) for k in TalkerParams.__dataclass_fields__}


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    return prompts


def _params_per_prompt(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return [sampling_params or SamplingParams()] * count
    params = list(sampling_params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling_params for {count} prompts; pass one or one each")
    return params
