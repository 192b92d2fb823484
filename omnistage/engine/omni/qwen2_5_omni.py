"""Qwen2.5-Omni as three stage specs: what each stage consumes and runs.

- **thinker**: the multimodal thinker on the paged, prefix-cached scheduler;
  a request that asks for audio returns its per-token rows (final hidden +
  input embedding), which the tensor prefix cache keeps whole on prefix hits;
- **talker**: codec tokens from those rows, on a paged scheduler of its own,
  prefix caching off (its token ids do not identify what the tokens hold);
  it consumes a ``TalkerRequest`` and samples with the ``TalkerParams``;
- **token2wav**: a chunked stage, codes to a waveform per request: one whole
  decode, or streamed in the DiT's chunks while the talker speaks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from omnistage.engine.arg_utils import EngineArgs
from omnistage.engine.input_processor import ProcessedInputs
from omnistage.engine.omni.pipeline import OmniPipeline
from omnistage.engine.omni.stage_io import TalkerParams, TalkerRequest, Token2WavRequest
from omnistage.engine.stage import StageSpec
from omnistage.engine.stage_engine import StageEngine
from omnistage.models.chunked_vocoder import ChunkedVocoder
from omnistage.models.loader import LoadedModel
from omnistage.models.qwen2_5_omni import OmniModel
from omnistage.models.qwen2_5_omni_talker import Qwen2_5OmniTalker
from omnistage.models.qwen2_5_omni_token2wav import Qwen2_5OmniToken2Wav

__all__ = ["OmniOptions", "build_omni_pipeline"]

TALKER_KV_CACHE_BYTES = 256 * 1024**2  # the talker's KV pool when no block count is given
# Talker prompt rows past the thinker's prompt (speaker bos, first reply row): the talker's
# context is sized as the thinker's plus these plus max_tokens.
TALKER_PROMPT_EXTRA = 2


@dataclass(frozen=True)
class OmniOptions:
    """What an omni checkpoint adds to the engine arguments.

    - ``talker_params``: overrides of the talker's sampling (``TalkerParams``:
      transformers' defaults; ``{"temperature": 0.0}`` is greedy);
    - ``talker_match_transformers_unpadded``: reproduce transformers 5.24's
      single-request talker path (see ``Qwen2_5OmniTalker``);
    - ``enable_tensor_prefix_cache``: keep the thinker's per-token rows beside
      its KV blocks, so that prefix hits still give the talker every row. Off
      with prefix caching on makes a hit raise at the hand-off;
    - ``talker_max_num_seqs``, ``talker_num_kv_blocks``, ``talker_max_model_len``:
      the talker stage's limits (default: the thinker's batch size, a 256 MiB
      pool, the thinker's length + 2 + the talker's ``max_tokens``); a request's
      talker ``max_tokens`` may not exceed what that length leaves;
    - ``token2wav_requests_per_step``: requests whose next chunk (or whole
      waveform) is decoded per pipeline step (``None``: the model's default,
      1 for Qwen2.5-Omni's per-request DiT, ``QWEN3_CODE2WAV_REQUESTS_PER_STEP``
      for Qwen3-Omni's code2wav, which decodes them in one batch).
    """

    talker_params: dict[str, Any] | None = None
    talker_match_transformers_unpadded: bool = False
    enable_tensor_prefix_cache: bool = True
    talker_max_num_seqs: int | None = None
    talker_num_kv_blocks: int | None = None
    talker_max_model_len: int | None = None
    token2wav_requests_per_step: int | None = None

    @classmethod
    def split(cls, kwargs: dict[str, Any]) -> tuple[OmniOptions, dict[str, Any]]:
        """``(options, the rest)`` of keyword arguments given to ``LLM``."""
        names = {f.name for f in dataclasses.fields(cls)}
        mine = {k: v for k, v in kwargs.items() if k in names}
        return cls(**mine), {k: v for k, v in kwargs.items() if k not in names}


class TalkerInputs:
    """The talker stage's input processor: a ``TalkerRequest`` becomes the talker's
    codec prompt ids, with its prefill rows, reply rows and positions
    (``TalkerPrompt``, built once here) as the request's payload."""

    def __init__(self, prep: Qwen2_5OmniTalker) -> None:
        self.prep = prep

    def process(self, request_id: str, request: TalkerRequest) -> ProcessedInputs:
        prompt = self.prep.prepare(request.handoff, request.speaker_bos_token_id)
        return ProcessedInputs(None, list(prompt.prompt_codec_ids), payload=prompt)


class Token2WavInputs:
    """The vocoder stage's input processor: the request rides along as the
    payload, with the vocoder's chunk schedule for its decode (the speaker was
    resolved when the request entered the pipeline). Each request's noise
    comes from its own seed, so its audio does not depend on what ran before."""

    def __init__(self, vocoder: ChunkedVocoder) -> None:
        self.vocoder = vocoder

    def process(self, request_id: str, request: Token2WavRequest) -> ProcessedInputs:
        payload = dataclasses.replace(request, schedule=self.vocoder.chunk_schedule(request.stream))
        return ProcessedInputs(None, list(request.codes), payload=payload)


def build_talker_stage(
    args: EngineArgs,
    options: OmniOptions,
    thinker: StageEngine,
    model: Any,
    hf_config: Any,
    max_position_embeddings: int,
    max_len: int,
    input_processor: Any,
) -> StageEngine:
    """An omni checkpoint's talker stage: its own KV pool and sequence bounds
    from ``options``, codec ids in and out (no tokenizer, no prefix caching:
    the ids do not identify what the payload rows hold)."""
    talker_args = dataclasses.replace(
        args,
        num_kv_blocks=options.talker_num_kv_blocks,
        kv_cache_memory_bytes=TALKER_KV_CACHE_BYTES,
        max_num_seqs=options.talker_max_num_seqs or args.max_num_seqs,
        max_model_len=max_len,
        speculative_config=None,  # the thinker speculates; the talker's inputs are payloads
    )
    talker_model = LoadedModel(
        model=model,
        tokenizer=None,  # codec ids are not text
        hf_config=hf_config,
        eos_token_ids=[],  # the stops come from TalkerParams
        max_model_len=max_position_embeddings,
        model_path=thinker.loaded_model.model_path,
        name=f"{thinker.loaded_model.name}:talker",
    )
    spec = StageSpec("talker", input_processor=input_processor, enable_prefix_caching=False)
    return StageEngine(talker_args, talker_model, spec)


def build_vocoder_stage(
    args: EngineArgs, talker: StageEngine, vocoder: ChunkedVocoder, name: str, requests_per_step: int
) -> StageEngine:
    """An omni checkpoint's vocoder as the chunked stage: a streamed request's
    codes are decoded chunk by chunk while the talker speaks, a whole one once
    its codes are final."""
    vocoder_model = dataclasses.replace(talker.loaded_model, model=vocoder, name=name)
    spec = StageSpec(
        "token2wav", kind="chunked", input_processor=Token2WavInputs(vocoder), max_requests_per_step=requests_per_step
    )
    return StageEngine(dataclasses.replace(args, speculative_config=None), vocoder_model, spec)


def build_omni_pipeline(args: EngineArgs, omni: OmniModel, options: OmniOptions | None = None) -> OmniPipeline:
    """The three stages of a loaded Qwen2.5-Omni checkpoint (only the thinker's
    without a talker), sharing its weights; each owns its KV cache."""
    options = options or OmniOptions()
    thinker = StageEngine(
        args, omni.thinker, StageSpec("thinker", enable_tensor_cache=options.enable_tensor_prefix_cache)
    )
    if not omni.has_audio_output:
        return OmniPipeline(thinker, None, None, omni.speakers, None, seed=args.seed)
    config = omni.talker_module.config
    defaults = TalkerParams.defaults(config, **(options.talker_params or {}))
    max_len = options.talker_max_model_len or min(
        int(config.max_position_embeddings), thinker.max_model_len + TALKER_PROMPT_EXTRA + defaults.max_tokens
    )
    prep = Qwen2_5OmniTalker(omni.talker_module, omni.talker_text_rows, options.talker_match_transformers_unpadded)
    talker = build_talker_stage(
        args, options, thinker, omni.paged_talker, config, int(config.max_position_embeddings), max_len,
        TalkerInputs(prep),
    )  # fmt: skip
    token2wav: Qwen2_5OmniToken2Wav = omni.token2wav  # type: ignore[assignment]
    vocoder = build_vocoder_stage(
        args, talker, token2wav, f"{omni.thinker.name}:token2wav", options.token2wav_requests_per_step or 1
    )
    sample_rate = int(token2wav.sample_rate)
    return OmniPipeline(
        thinker, talker, vocoder, omni.speakers, defaults, seed=args.seed, sample_rate=sample_rate,
        talker_prompt_extra=TALKER_PROMPT_EXTRA,
    )  # fmt: skip
