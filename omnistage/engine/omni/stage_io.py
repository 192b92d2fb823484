"""Plain per-request data handed between omni stages, and what a stage offers.

Stages never call each other: the pipeline steps each stage, takes the
requests that stage finished, and adds them, as the dataclasses below, to the
next stage. Tensors in these records are on CPU and owned by the record (no
views into a stage's batch buffers), so a stage may run on another device,
thread or process.

    thinker --ThinkerOutputForTalker--> talker --Token2WavRequest--> token2wav
            (wrapped in TalkerRequest)                    --AudioOutput-->
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np

from omnistage.models.qwen2_5_omni_talker import ThinkerOutputForTalker

__all__ = [
    "DEFAULT_SPEAKER",
    "AudioOutput",
    "Stage",
    "TalkerRequest",
    "Token2WavRequest",
    "resolve_speaker",
    "talker_sampling_defaults",
]

DEFAULT_SPEAKER = "Chelsie"  # transformers' generate() default for Qwen2.5-Omni


@dataclass
class TalkerRequest:
    """Thinker -> talker: a finished thinker request that asked for audio.

    ``seed`` seeds the talker's sampling and, passed on, token2wav's noise;
    the pipeline sets it from ``SamplingParams.seed`` or, when that is None,
    from its own generator, so every request has one.
    """

    handoff: ThinkerOutputForTalker
    speaker: str
    speaker_bos_token_id: int
    seed: int
    max_codes: int = 4096  # generate()'s talker_max_new_tokens

    @property
    def request_id(self) -> str:
        return self.handoff.request_id


@dataclass
class Token2WavRequest:
    """Talker -> token2wav: the codec tokens of a request, EOS excluded."""

    request_id: str
    codes: list[int]
    speaker: str
    seed: int


@dataclass
class AudioOutput:
    """Token2wav -> the pipeline's output: a 1-D float32 waveform."""

    request_id: str
    audio: np.ndarray
    sample_rate: int

    def __post_init__(self) -> None:
        if self.audio.dtype != np.float32 or self.audio.ndim != 1:
            raise ValueError(
                f"request {self.request_id}: audio must be 1-D float32, got {self.audio.dtype} {self.audio.shape}"
            )


InT = TypeVar("InT", contravariant=True)
OutT = TypeVar("OutT", covariant=True)


class Stage(Protocol[InT, OutT]):
    """One pipeline stage: its own scheduler and runner, batching whatever
    requests it holds each step (continuous batching per stage)."""

    def add_request(self, request: InT) -> None:
        """Queue a request; raises ValueError naming it when unusable."""

    def abort_request(self, request_ids: Iterable[str]) -> None:
        """Drop requests wherever they are (unknown ids are ignored); their
        blocks, cached rows and staged tensors are released."""

    def step(self) -> list[OutT]:
        """Run one step; return the requests that finished in it."""

    def has_unfinished_requests(self) -> bool: ...


def resolve_speaker(speaker: str | None, speakers: Mapping[str, Any]) -> str:
    """``None`` means the checkpoint's default voice: "Chelsie" when the
    checkpoint has it (as transformers assumes), else its first speaker."""
    if not speakers:
        raise ValueError("this checkpoint has no speakers (spk_dict.pt), so it cannot produce audio")
    if speaker is None:
        return DEFAULT_SPEAKER if DEFAULT_SPEAKER in speakers else sorted(speakers)[0]
    if speaker not in speakers:
        raise ValueError(f"unknown speaker {speaker!r}; this checkpoint has {sorted(speakers)}")
    return speaker


def talker_sampling_defaults(talker_config: Any) -> dict[str, Any]:
    """transformers' ``generate()`` defaults for the talker, in omnistage's
    terms. ``repetition_penalty`` counts the talker prompt's codec ids (mask,
    pad, bos) as seen; ``suppress_token_ids`` get ``-inf`` logits."""
    return {
        "temperature": 0.9,
        "top_k": 40,
        "top_p": 0.8,
        "repetition_penalty": 1.05,
        "max_tokens": 4096,
        "stop_token_ids": [int(talker_config.tts_codec_pad_token_id), int(talker_config.tts_codec_end_token_id)],
        "suppress_token_ids": [int(talker_config.tts_codec_start_token_id)],
    }
