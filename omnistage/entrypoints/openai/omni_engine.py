"""An omni pipeline (thinker -> talker -> token2wav) behind the engine interface the server drives.

``EngineClient`` steps whatever engine it is given through ``add_request``,
``abort_request``, ``step``, ``has_unfinished_requests`` and ``get_stats``,
and the serving code reads ``tokenizer``, ``encode_chat``, ``max_model_len``
and the modality sets. ``OmniEngine`` offers exactly that on top of an
``OmniLLM``'s ``OmniPipeline``, so ``omnistage serve --model <omni folder>``
serves text and speech with the same server code as a plain LLM.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from omnistage.outputs import RequestOutput

if TYPE_CHECKING:  # the server imports this module for every model; the pipeline loads with an omni one
    from omnistage.engine.arg_utils import EngineArgs
    from omnistage.engine.llm_engine import EngineStats, PromptType
    from omnistage.entrypoints.omni_llm import OmniLLM
    from omnistage.sampling_params import SamplingParams

__all__ = ["OmniEngine", "OmniRequestParams"]


@dataclass(frozen=True)
class OmniRequestParams:
    """What a chat request asks of an omni engine: the thinker's sampling, and
    whether the talker speaks the answer, in which voice (None: the default)."""

    sampling: SamplingParams
    return_audio: bool = False
    voice: str | None = None


class OmniEngine:
    """``LLMEngine``'s serving interface over an ``OmniPipeline``.

    Policy:

    - ``add_request`` takes ``SamplingParams`` (text only: the talker and
      token2wav do no work) or ``OmniRequestParams`` (audio when asked).
    - ``step()`` returns cumulative outputs, as ``LLMEngine`` does: the
      thinker's progress for every request still running, so text streams
      while it is generated, then the complete output once, with ``audio``
      (float32) and ``sample_rate`` when audio was asked. A request waiting
      for its audio is reported unfinished, with no finish reason, so a
      stream's finish chunk comes after the audio.
    - ``get_stats()`` is the thinker engine's: the stage clients wait on, and
      the one whose KV blocks prompts occupy. ``num_held_kv_blocks()`` counts
      every stage's blocks, for the server's clean-up check.

    Thread-confined like ``LLMEngine``: every call from the engine thread.
    """

    def __init__(self, llm: OmniLLM) -> None:
        self.llm = llm
        self.pipeline = llm.pipeline
        thinker = self.pipeline.thinker.engine
        self.thinker_engine = thinker
        self.loaded_model = thinker.loaded_model
        self.tokenizer = thinker.tokenizer
        self.max_model_len = thinker.max_model_len
        self.input_modalities = thinker.input_modalities
        speaks = self.pipeline.has_audio_output
        self.output_modalities = frozenset({"text", "audio"} if speaks else {"text"})
        self.voices: tuple[str, ...] = tuple(sorted(self.pipeline.speakers)) if speaks else ()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, talker_params: dict[str, Any] | None = None) -> OmniEngine:
        """Load the checkpoint at ``args.model``; ``talker_params`` override the
        talker's sampling (``TalkerParams`` fields) for every request."""
        from omnistage.entrypoints.omni_llm import OmniLLM

        kwargs = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.name != "model"}
        return cls(OmniLLM(str(args.model), talker_params=talker_params, **kwargs))

    # ------------------------------------------------------------------ requests

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | OmniRequestParams | None) -> None:
        """Queue a request; ValueError (nothing queued) for a bad prompt, voice or ``n`` with audio."""
        if isinstance(params, OmniRequestParams):
            self.pipeline.add_request(request_id, prompt, params.sampling, params.return_audio, params.voice)
        else:
            self.pipeline.add_request(request_id, prompt, params, return_audio=False)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        self.pipeline.abort_request(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.pipeline.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        done = self.pipeline.step()
        return [_still_running(out) for out in self.pipeline.progress] + done

    # ------------------------------------------------------------------ serving helpers

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> dict[str, Any]:
        return self.thinker_engine.encode_chat(messages, add_generation_prompt, **kwargs)

    def get_stats(self) -> EngineStats:
        return self.thinker_engine.get_stats()

    def num_held_kv_blocks(self) -> int:
        return sum(v for k, v in self.pipeline.held().items() if k.endswith("kv_blocks"))

    def held(self) -> dict[str, int]:
        return self.pipeline.held()


def _still_running(out: RequestOutput) -> RequestOutput:
    """A thinker output as progress of a request the pipeline has not completed.

    Only one whose text is done (its audio is not) needs changing; it is copied,
    not edited, because the pipeline later completes that same object with the audio.
    """
    if not out.finished:
        return out
    outputs = [dataclasses.replace(c, finish_reason=None, stop_reason=None) for c in out.outputs]
    return dataclasses.replace(out, finished=False, outputs=outputs)
