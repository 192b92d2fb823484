"""Qwen3-Omni as three stage specs on the same stage engine as Qwen2.5-Omni.

- **thinker**: the MoE multimodal thinker, paged and prefix-cached; a request
  that asks for audio returns its per-token rows (input embedding, or the
  accepted layer at media placeholders), kept whole on hits by the tensor
  prefix cache;
- **talker**: the MoE talker on its own paged scheduler (prefix caching off:
  its token ids do not identify its inputs). Each step samples code 0 with the
  ``TalkerParams`` and runs the code predictor for the other groups; the
  frames are the model's deferred key ``codes.audio``;
- **code2wav**: the chunked vocoder stage (``ChunkedVocoder``): frames decoded in
  chunks as the talker makes them when streamed, else once; every chunk re-reads
  its left context, so both are the full decode's samples exactly. A step's
  chunks of several requests decode in one right-padded forward.
"""

from __future__ import annotations

from typing import Any

from omnistage.engine.arg_utils import EngineArgs
from omnistage.engine.input_processor import ProcessedInputs
from omnistage.engine.omni.pipeline import OmniPipeline
from omnistage.engine.omni.qwen2_5_omni import OmniOptions, build_talker_stage, build_vocoder_stage
from omnistage.engine.omni.stage_io import TalkerParams, TalkerRequest
from omnistage.engine.stage import StageSpec
from omnistage.engine.stage_engine import StageEngine
from omnistage.models.qwen3_omni import DEFAULT_QWEN3_SPEAKER, Qwen3OmniModel
from omnistage.models.qwen3_omni_talker import Qwen3TalkerPrep

__all__ = ["QWEN3_CODE2WAV_REQUESTS_PER_STEP", "build_qwen3_omni_pipeline"]

# The code2wav stage decodes the ready chunks of up to this many requests in one
# right-padded forward (exact: the vocoder is causal); a chunk is at most 12 frames
# plus its left context, so a batch stays small.
QWEN3_CODE2WAV_REQUESTS_PER_STEP = 8
# At most this many talker prompt rows past the thinker prompt's user turns (the codec
# prefix, 9 rows): the talker's context is sized as the thinker's plus these plus max_tokens.
QWEN3_TALKER_PROMPT_EXTRA = 16


class Qwen3TalkerInputs:
    """The talker stage's input processor: a ``TalkerRequest`` becomes the request's
    ``Qwen3TalkerState`` (its payload), built once here."""

    def __init__(self, prep: Qwen3TalkerPrep) -> None:
        self.prep = prep

    def process(self, request_id: str, request: TalkerRequest) -> ProcessedInputs:
        greedy = request.talker_params is None or request.talker_params.temperature == 0
        state = self.prep.prepare(
            request.handoff,
            request.speaker_bos_token_id,
            greedy=greedy,
            seed=request.seed,
        )
        return ProcessedInputs(None, list(state.prompt_ids), payload=state)


def build_qwen3_omni_pipeline(
    args: EngineArgs, omni: Qwen3OmniModel, options: OmniOptions | None = None
) -> OmniPipeline:
    """The three stages of a loaded Qwen3-Omni checkpoint (only the thinker's without a talker)."""
    options = options or OmniOptions()
    thinker = StageEngine(
        args,
        omni.thinker,
        StageSpec("thinker", enable_tensor_cache=options.enable_tensor_prefix_cache),
    )
    if not omni.has_audio_output:
        return OmniPipeline(
            thinker,
            None,
            None,
            {},
            None,
            seed=args.seed,
            default_speaker=DEFAULT_QWEN3_SPEAKER,
        )
    tc = omni.config.talker_config
    defaults = TalkerParams.qwen3_defaults(tc, **(options.talker_params or {}))
    text = tc.text_config
    max_len = options.talker_max_model_len or min(
        int(text.max_position_embeddings),
        thinker.max_model_len + QWEN3_TALKER_PROMPT_EXTRA + defaults.max_tokens,
    )
    assert omni.prep is not None and omni.code2wav is not None
    talker = build_talker_stage(
        args, options, thinker, omni.talker, tc, int(text.max_position_embeddings), max_len,
        Qwen3TalkerInputs(omni.prep),
    )  # fmt: skip
    # Code2wav is causal: streamed or whole, the chunks give the full decode's samples.
    vocoder = build_vocoder_stage(
        args, talker, omni.code2wav, f"{omni.thinker.name}:code2wav",
        options.token2wav_requests_per_step or QWEN3_CODE2WAV_REQUESTS_PER_STEP,
    )  # fmt: skip
    # Voices as users name them ("Ethan"); the config spells them lower-case and
    # transformers lower-cases what it is given, as resolve_speaker matches.
    speakers: dict[str, Any] = {
        name[:1].upper() + name[1:]: cid for name, cid in omni.speakers.items()
    }
    return OmniPipeline(
        thinker, talker, vocoder, speakers, defaults, seed=args.seed,
        sample_rate=int(omni.code2wav.sample_rate), default_speaker=DEFAULT_QWEN3_SPEAKER,
        talker_prompt_extra=QWEN3_TALKER_PROMPT_EXTRA,
    )  # fmt: skip
