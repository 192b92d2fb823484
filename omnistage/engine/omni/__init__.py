"""Multi-stage omni pipelines (thinker -> talker -> token2wav).

Each stage is a ``StageEngine`` configured by a ``StageSpec``; the pipeline
(``pipeline``) steps them in turn and hands requests on as the plain records
of ``stage_io``. The design is in ``docs/design.md``; the model-specific stage
math lives in ``omnistage.models.qwen2_5_omni*``.
"""

from omnistage.engine.omni.pipeline import OmniPipeline
from omnistage.engine.omni.qwen2_5_omni import OmniOptions, build_omni_pipeline
from omnistage.engine.omni.stage_io import DEFAULT_SPEAKER, TalkerParams, TalkerRequest, Token2WavRequest, resolve_speaker

__all__ = [
    "DEFAULT_SPEAKER",
    "OmniOptions",
    "OmniPipeline",
    "TalkerParams",
    "TalkerRequest",
    "Token2WavRequest",
    "build_omni_pipeline",
    "resolve_speaker",
]
