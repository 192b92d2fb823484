"""Qwen3-Omni as three stage specs on the same stage engine as Qwen2.5-Omni.

- **thinker**: the MoE multimodal thinker, paged and prefix-cached; a request
  that asks for audio returns its per-token rows (input embedding, or the
  accepted layer at media placeholders), kept whole on hits by the tensor
  prefix cache;
- **talker**: the MoE talker on its own paged scheduler (prefix caching off:
  its token ids do not identify its inputs). Each step samples code 0 with the
  ``TalkerParams`` and runs the code predictor for the other groups; the
  frames are the model's deferred key ``codes.audio``;
- **code2wav**: one-shot, the causal vocoder, up to ``token2wav_requests_per_step``
  requests decoded together per step (right-padded: exact, the model is causal).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from omnistage.engine.arg_utils import EngineArgs
from omnistage.engine.input_processor import ProcessedInputs
from omnistage.engine.omni.pipeline import OmniPipeline
from omnistage.engine.omni.qwen2_5_omni import TALKER_KV_CACHE_BYTES, OmniOptions
from omnistage.engine.omni.stage_io import TalkerParams, TalkerRequest, Token2WavRequest
from omnistage.engine.stage import StageSpec
from omnistage.engine.stage_engine import StageEngine
from omnistage.models.loader import LoadedModel
from omnistage.models.qwen3_omni import DEFAULT_QWEN3_SPEAKER, Qwen3OmniModel
from omnistage.models.qwen3_omni_code2wav import Qwen3OmniCode2Wav
from omnistage.models.qwen3_omni_talker import Qwen3TalkerPrep, frames_tensor

__all__ = ["build_qwen3_omni_pipeline"]


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


class Code2WavInputs:
    """The vocoder stage's input processor: the frames ride along as the payload."""

    def process(self, request_id: str, request: Token2WavRequest) -> ProcessedInputs:
        if request.frames is None:
            raise ValueError(
                f"code2wav request {request_id!r}: no frames (every code group of each frame)"
            )
        return ProcessedInputs(
            None, [int(f[0]) for f in request.frames] or [0], payload=request
        )


class Code2WavModel:
    """Qwen3-Omni's code2wav as a one-shot stage model: ``{"audio": 1-D float32}``.
    ``run_batch`` decodes the step's requests in one forward (exact: causal)."""

    def __init__(self, code2wav: Qwen3OmniCode2Wav) -> None:
        self.code2wav = code2wav

    def _codes(self, request: Token2WavRequest) -> np.ndarray:
        return frames_tensor(request.frames or [], self.code2wav.num_quantizers)

    def __call__(self, request: Token2WavRequest) -> dict[str, np.ndarray]:
        return {"audio": self.code2wav.decode(self._codes(request))}

    def run_batch(
        self, requests: list[Token2WavRequest]
    ) -> list[dict[str, np.ndarray]]:
        return [
            {"audio": a}
            for a in self.code2wav.decode_batch([self._codes(r) for r in requests])
        ]


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
        thinker.max_model_len + 16 + defaults.max_tokens,
    )
    talker_args = dataclasses.replace(
        args,
        num_kv_blocks=options.talker_num_kv_blocks,
        kv_cache_memory_bytes=TALKER_KV_CACHE_BYTES,
        max_num_seqs=options.talker_max_num_seqs or args.max_num_seqs,
        max_model_len=max_len,
        speculative_config=None,
    )
    talker_model = LoadedModel(
        model=omni.talker,  # type: ignore[arg-type]
        tokenizer=None,  # codec ids are not text
        hf_config=tc,
        eos_token_ids=[],  # the stops come from TalkerParams
        max_model_len=int(text.max_position_embeddings),
        model_path=omni.thinker.model_path,
        name=f"{omni.thinker.name}:talker",
    )
    assert omni.prep is not None and omni.code2wav is not None
    talker = StageEngine(
        talker_args,
        talker_model,
        StageSpec(
            "talker",
            input_processor=Qwen3TalkerInputs(omni.prep),
            enable_prefix_caching=False,
        ),
    )
    vocoder_model = dataclasses.replace(
        talker_model,
        model=Code2WavModel(omni.code2wav),
        name=f"{omni.thinker.name}:code2wav",  # type: ignore[arg-type]
    )
    vocoder = StageEngine(
        dataclasses.replace(args, speculative_config=None),
        vocoder_model,
        StageSpec(
            "token2wav",
            kind="one_shot",
            input_processor=Code2WavInputs(),
            max_requests_per_step=options.token2wav_requests_per_step,
        ),
    )
    # Voices as users name them ("Ethan"); the config spells them lower-case and
    # transformers lower-cases what it is given, as resolve_speaker matches.
    speakers: dict[str, Any] = {
        name[:1].upper() + name[1:]: cid for name, cid in omni.speakers.items()
    }
    return OmniPipeline(
        thinker, talker, vocoder, speakers, defaults, seed=args.seed,
        sample_rate=int(omni.code2wav.sample_rate), default_speaker=DEFAULT_QWEN3_SPEAKER,
    )  # fmt: skip
