"""Multi-stage omni pipelines (thinker -> talker -> token2wav).

Each stage is an engine of its own (scheduler, KV cache, model runner) and
stages exchange plain per-request data (``stage_io``):

- ``ThinkerStage`` (``thinker_stage``): an ``LLMEngine`` whose runner keeps the
  talker's per-token rows, with the tensor prefix cache on prefix hits;
- ``TalkerStage`` (``talker_stage``): codec tokens on a paged engine, with KV
  prefix caching off;
- ``Token2WavStage`` (``token2wav_stage``): waveforms, first come first served;
- ``OmniPipeline`` (``pipeline``): steps them and moves requests on.

The design is in ``docs/omni_pipeline.md``; the model-specific stage math
lives in ``omnistage.models.qwen2_5_omni_talker`` and
``omnistage.models.qwen2_5_omni_token2wav``.
"""

from omnistage.engine.omni.stage_io import (
    DEFAULT_SPEAKER,
    AudioOutput,
    Stage,
    TalkerRequest,
    Token2WavRequest,
    resolve_speaker,
    talker_sampling_defaults,
)

__all__ = [
    "DEFAULT_SPEAKER",
    "AudioOutput",
    "Stage",
    "TalkerRequest",
    "Token2WavRequest",
    "resolve_speaker",
    "talker_sampling_defaults",
]
