"""Plain per-request records handed between omni stages, and the talker's sampling.

Stages never call each other: the pipeline steps each stage, takes the
requests that stage finished, and adds them, as the records below, to the
next stage. Tensors in these records are on CPU and owned by the record (no
views into a stage's batch buffers), so a stage may later run on another
device, thread or process.

    thinker --ThinkerOutputForTalker--> talker --Token2WavRequest--> token2wav
            (wrapped in TalkerRequest)          (then its codes, as they come)
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from omnistage.core.chunk_schedule import ChunkSchedule
from omnistage.models.qwen2_5_omni_talker import ThinkerOutputForTalker
from omnistage.sampling_params import SamplingParams

__all__ = [
    "DEFAULT_SPEAKER",
    "TalkerParams",
    "TalkerRequest",
    "Token2WavRequest",
    "ThinkerOutputForTalker",
    "resolve_speaker",
]

DEFAULT_SPEAKER = "Chelsie"  # transformers' generate() default for Qwen2.5-Omni


@dataclass
class TalkerRequest:
    """Thinker -> talker: a finished thinker request that asked for audio.

    ``seed`` seeds the talker's sampling and, passed on, token2wav's noise;
    the pipeline sets it from ``SamplingParams.seed`` or, when that is None,
    from its own seed, so every request has one.
    """

    handoff: ThinkerOutputForTalker
    speaker: str
    speaker_bos_token_id: int  # Qwen2.5-Omni: the speaker's text bos id; Qwen3-Omni: its codec id
    seed: int
    talker_params: TalkerParams | None = None

    @property
    def request_id(self) -> str:
        return self.handoff.request_id


@dataclass
class Token2WavRequest:
    """Talker -> token2wav: the codec tokens of a request known so far, its
    stop code excluded (the pipeline extends them as the talker makes more).

    ``stream``: decode in the vocoder's streaming chunks (else one whole
    decode once the codes are final); ``schedule`` is the vocoder's schedule
    for that choice, set by the stage's input processor."""

    request_id: str
    codes: list[int]
    speaker: str
    seed: int
    stream: bool = False
    schedule: ChunkSchedule | None = None


@dataclass(frozen=True)
class TalkerParams:
    """How the talker picks codes; the defaults are transformers' ``generate()`` defaults.

    ``temperature=0`` is greedy (``talker_do_sample=False``).
    ``repetition_penalty`` counts the talker prompt's codec ids (mask, pad,
    bos) as seen; ``suppress_token_ids`` are never sampled.

    Values are checked when the parameters are built (or replaced), as the
    talker's ``SamplingParams`` would check them, so a bad one is refused
    before its request queues; errors name ``talker_params.<field>``.
    """

    temperature: float = 0.9
    top_k: int = 40
    top_p: float = 0.8
    repetition_penalty: float = 1.05
    max_tokens: int = 4096  # generate()'s talker_max_new_tokens
    stop_token_ids: tuple[int, ...] = ()
    suppress_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for key in ("stop_token_ids", "suppress_token_ids"):
            value = getattr(self, key)
            if _is_id_list(value):
                object.__setattr__(self, key, tuple(value))  # anything else is refused below
        # Checked here: SamplingParams' None ("up to the context") has no meaning for the talker.
        tokens = self.max_tokens
        if not isinstance(tokens, numbers.Integral) or isinstance(tokens, bool) or tokens < 1:
            raise ValueError(f"talker_params.max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        self.sampling_params()

    @classmethod
    def defaults(cls, talker_config: Any, **overrides: Any) -> TalkerParams:
        """transformers' defaults for this talker (its stop and start codes), then ``overrides``."""
        base = cls(
            stop_token_ids=(int(talker_config.tts_codec_pad_token_id), int(talker_config.tts_codec_end_token_id)),
            suppress_token_ids=(int(talker_config.tts_codec_start_token_id),),
        )
        return base.replace(**overrides)

    @classmethod
    def qwen3_defaults(cls, talker_config: Any, **overrides: Any) -> TalkerParams:
        """Qwen3-Omni ``generate()``'s talker defaults: temperature 0.9, top-k 50, top-p 1,
        repetition penalty 1.05, stop at codec EOS, the top 1024 codec ids but EOS suppressed.

        Those suppressed ids are control codes past the codebook, which code2wav cannot
        embed: ``replace`` keeps them suppressed whatever a request asks."""
        vocab, eos = int(talker_config.text_config.vocab_size), int(talker_config.codec_eos_token_id)
        base = cls(
            temperature=0.9,
            top_k=50,
            top_p=1.0,
            stop_token_ids=(eos,),
            suppress_token_ids=tuple(i for i in range(max(0, vocab - 1024), vocab) if i != eos),
        )
        return base.replace(**overrides)

    def replace(self, **overrides: Any) -> TalkerParams:
        """These parameters with some fields replaced; unknown names and bad values are refused.

        ``suppress_token_ids`` extends the suppressed ids, never replaces them: the
        defaults suppress the codes the model must not sample (its start code, its
        control codes), and dropping them would make codes the vocoder cannot decode."""
        names = {f.name for f in fields(self)}
        unknown = set(overrides) - names
        if unknown:
            raise ValueError(f"unknown talker parameters {sorted(unknown)}; expected some of {sorted(names)}")
        extra = overrides.get("suppress_token_ids")
        if _is_id_list(extra):
            overrides["suppress_token_ids"] = tuple(dict.fromkeys([*self.suppress_token_ids, *extra]))
        return dataclasses.replace(self, **overrides)

    def sampling_params(self, seed: int | None = None, max_tokens: int | None = None) -> SamplingParams:
        """The talker's ``SamplingParams`` for a request (``max_tokens``: this one's, by default);
        a ``ValueError`` names the ``talker_params`` field at fault."""
        try:
            return SamplingParams(
                temperature=self.temperature,
                top_k=self.top_k,
                top_p=self.top_p,
                max_tokens=self.max_tokens if max_tokens is None else max_tokens,
                stop_token_ids=self.stop_token_ids,
                repetition_penalty=self.repetition_penalty,
                suppress_token_ids=self.suppress_token_ids,
                seed=seed,
            )
        except ValueError as exc:
            raise ValueError(str(exc).replace("SamplingParams.", "talker_params.", 1)) from None


def _is_id_list(value: Any) -> bool:
    """A collection to take as token ids (a string or a single number is not one)."""
    return isinstance(value, Iterable) and not isinstance(value, (str, bytes))


def resolve_speaker(speaker: str | None, speakers: Mapping[str, Any], default: str = DEFAULT_SPEAKER) -> str:
    """``None`` means the checkpoint's default voice: ``default`` when the
    checkpoint has it (as transformers assumes), else its first speaker. Names
    match case-insensitively (transformers lower-cases Qwen3-Omni's)."""
    if not speakers:
        raise ValueError("this checkpoint has no speakers, so it cannot produce audio")
    by_case = {name.lower(): name for name in speakers}
    if speaker is None:
        speaker = default
        if speaker.lower() not in by_case:
            return sorted(speakers)[0]
    speaker = by_case.get(speaker.lower(), speaker)
    if speaker not in speakers:
        raise ValueError(f"unknown speaker {speaker!r}; this checkpoint has {sorted(speakers)}")
    return speaker
