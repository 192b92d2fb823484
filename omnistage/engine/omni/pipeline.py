"""An omni pipeline: stage engines stepped in turn, requests handed on as soon as a stage is done.

The stages (thinker, talker, token2wav) are ``StageEngine``s built from their
specs by ``engine.omni.qwen2_5_omni``; the hand-offs between them are the
plain records of ``stage_io``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from omnistage.core.chunk_schedule import ChunkSchedule
from omnistage.engine.arg_utils import EngineArgs
from omnistage.engine.input_processor import ProcessedInputs, PromptType
from omnistage.engine.stage import StageHeld
from omnistage.engine.stage_engine import EngineStats, StageEngine
from omnistage.engine.omni.stage_io import (
    DEFAULT_SPEAKER,
    TalkerParams,
    TalkerRequest,
    ThinkerOutputForTalker,
    Token2WavRequest,
    resolve_speaker,
)
from omnistage.multimodal.inputs import MultiModalFeatureSpec
from omnistage.outputs import RequestOutput
from omnistage.sampling_params import SamplingParams

__all__ = ["OmniPipeline"]

@dataclass
class _Pending:
    """A request on its way through the stages."""

    speaker: str
    speaker_bos_token_id: int
    seed: int
    talker_params: TalkerParams | None  # None: no audio asked
    grids: dict[str, torch.Tensor | None]  # the prompt's grids, for the talker's positions
    stream_audio: bool = False  # decode in the vocoder's streaming chunks
    output: RequestOutput | None = None  # the thinker's, once finished
    codes: list[int] | None = None  # the talker's, once finished
    talker_state: Any = None  # the talker stage's payload (Qwen3-Omni: its frames)
    frames: list[list[int]] | None = None  # every code group of each frame the vocoder got (Qwen3-Omni)
    vocoding: bool = False  # in the vocoder stage (added once its first chunk was ready)
    units_checked: int = 0  # the vocoder units already checked against its codebook
    audio_chunks: list[np.ndarray] = dataclasses.field(default_factory=list)


class OmniPipeline:
    """Stage engines, each batching on its own, stepped in turn by ``step()``.

    It has a stage engine's interface (``add_request``, ``abort_request``,
    ``step``, ``has_unfinished_requests``, ``get_stats``), so ``LLM`` and the
    server drive it as they drive one stage; ``add_request`` adds the audio
    options.

    A request that the thinker finishes this step enters the talker in the
    same step. It enters the vocoder stage (a chunked stage) in the step its
    first chunk is ready: for a whole decode when the talker finishes, for a
    streamed one (``stream_audio=True``) once the talker has made the codes of
    the vocoder's first streaming chunk; from then on each talker step hands
    it the codes so far. ``step()`` returns cumulative outputs as a stage
    engine does: the thinker's text while it is generated, and, for a request
    that asked for audio, the text again reported unfinished (no finish
    reason) with ``audio_chunks`` growing as the vocoder makes them; then the
    complete output once, with ``audio`` (1-D float32, the chunks
    concatenated) and ``sample_rate``.

    A request that fails in a stage, or whose hand-off to the next stage
    fails, ends alone: its output comes back finished with ``error`` set and
    every stage lets go of it, while the step goes on for the others.

    Talker limits: a request's talker ``max_tokens`` may not exceed
    ``talker_max_tokens``, what the talker's context was sized for: its
    ``max_model_len`` less the longest talker prompt the thinker's context can
    give (``talker_prompt_extra`` rows past the thinker's prompt), or the
    default ``max_tokens`` when that is larger. A larger one is refused at
    ``add_request`` rather than silently cut. Codes the vocoder cannot decode
    (past its ``codebook_size``) fail their own request at the hand-off, never
    a vocoder batch of others.

    Seeds: a request's seed is ``SamplingParams.seed``, or the pipeline's
    ``seed`` when that is None. It drives the talker's sampling and
    token2wav's initial noise, which is then the noise transformers draws
    right after ``torch.manual_seed(seed)``.
    """

    def __init__(
        self,
        thinker: StageEngine,
        talker: StageEngine | None,
        token2wav: StageEngine | None,
        speakers: dict[str, dict],
        default_talker_params: TalkerParams | None,
        seed: int = 0,
        sample_rate: int = 24000,
        default_speaker: str | None = None,
        talker_prompt_extra: int = 0,
    ) -> None:
        self.stages: dict[str, StageEngine] = {"thinker": thinker}
        if talker is not None and token2wav is not None:
            self.stages.update(talker=talker, token2wav=token2wav)
        self.thinker = thinker
        self.speakers = speakers
        self.default_talker_params = default_talker_params
        self.seed = seed
        self.sample_rate = sample_rate
        self.default_speaker = default_speaker
        self.talker_max_tokens: int | None = None
        if talker is not None and default_talker_params is not None:
            sized = talker.max_model_len - thinker.max_model_len - talker_prompt_extra
            self.talker_max_tokens = max(default_talker_params.max_tokens, sized)
        self._pending: dict[str, _Pending] = {}

    # -- what the serving code reads, as of a stage engine --------------------------

    @property
    def has_audio_output(self) -> bool:
        return "talker" in self.stages

    @property
    def output_modalities(self) -> frozenset[str]:
        return frozenset({"text", "audio"} if self.has_audio_output else {"text"})

    @property
    def voices(self) -> tuple[str, ...]:
        return tuple(sorted(self.speakers)) if self.has_audio_output else ()

    # The thinker answers everything about prompts and text.
    @property
    def tokenizer(self) -> Any:
        return self.thinker.tokenizer

    @property
    def loaded_model(self) -> Any:
        return self.thinker.loaded_model

    @property
    def args(self) -> EngineArgs:
        return self.thinker.args

    @property
    def max_model_len(self) -> int:
        return self.thinker.max_model_len

    @property
    def input_modalities(self) -> frozenset[str]:
        return self.thinker.input_modalities

    def process_inputs(
        self, request_id: str, prompt: PromptType | ProcessedInputs, truncate_prompt_tokens: int | None = None
    ) -> ProcessedInputs:
        return self.thinker.process_inputs(request_id, prompt, truncate_prompt_tokens)

    def encode_chat(self, messages: list[dict[str, Any]], *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self.thinker.encode_chat(messages, *args, **kwargs)

    def apply_chat_template(self, messages: list[dict[str, Any]], *args: Any, **kwargs: Any) -> str:
        return self.thinker.apply_chat_template(messages, *args, **kwargs)

    def get_num_unfinished_requests(self) -> int:
        return len(self._pending)

    def get_stats(self) -> EngineStats:
        """The thinker's: the stage clients wait on, and the one whose KV blocks prompts occupy."""
        return self.thinker.get_stats()

    def held(self) -> dict[str, StageHeld]:
        """What each stage still holds, plus the requests the pipeline tracks."""
        held = {name: stage.held() for name, stage in self.stages.items()}
        held["pipeline"] = StageHeld(requests=len(self._pending))
        return held

    def speakable_frames(self, request_id: str) -> list[list[int]]:
        """Qwen3-Omni: the frames of ``request_id`` that are audio for sure, so far (every
        code group of each). A frame is final once a later code was sampled: the last
        sampled code's frame is never audio. Empty for other models or unknown ids; for
        streaming, feed the new ones to the vocoder's ``stream()``."""
        pending = self._pending.get(request_id)
        frames = getattr(pending.talker_state, "frames", None) if pending is not None else None
        if pending is not None and pending.frames is not None:
            return pending.frames  # the talker finished: exactly what the vocoder gets
        return [list(f) for f in frames[:-1]] if frames else []

    # -- requests ----------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: PromptType | ProcessedInputs,
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
        *,
        return_audio: bool | None = None,
        speaker: str | None = None,
        talker_params: TalkerParams | dict[str, Any] | None = None,
        stream_audio: bool = False,
    ) -> None:
        """Queue a request; raises ValueError, queuing nothing, when it cannot run.

        ``return_audio=None`` speaks when the checkpoint can; ``speaker=None``
        is the checkpoint's default voice; ``talker_params`` override the
        talker's sampling for this request (``suppress_token_ids`` extend the
        defaults'; ``max_tokens`` up to ``talker_max_tokens``); ``stream_audio`` decodes its audio
        in the vocoder's streaming chunks while the talker speaks (else one
        whole decode, which for Qwen2.5-Omni equals transformers')."""
        params = SamplingParams() if sampling_params is None else sampling_params
        if request_id in self._pending:
            raise ValueError(f"request {request_id!r}: a request with this id is already running")
        if return_audio is None:
            return_audio = self.has_audio_output
        if return_audio and not self.has_audio_output:
            raise ValueError("this checkpoint has no talker and token2wav, so it cannot return audio")
        name, bos, chosen = "", -1, None
        if return_audio and params.n != 1:
            raise ValueError(f"request {request_id!r}: audio output supports n=1 only, got n={params.n}")
        if return_audio:
            name = resolve_speaker(speaker, self.speakers, self.default_speaker or DEFAULT_SPEAKER)
            voice = self.speakers[name]  # Qwen2.5-Omni: {"bos_token": text id, ...}; Qwen3-Omni: a codec id
            bos = int(voice["bos_token"]) if isinstance(voice, dict) else int(voice)
            chosen = self._talker_params(talker_params)
        inputs = self.thinker.process_inputs(request_id, prompt, params.truncate_prompt_tokens)
        self.thinker.add_request(request_id, inputs, params, arrival_time, return_hidden_states=return_audio)
        seed = self.seed if params.seed is None else params.seed
        grids = _grid_fields(inputs.mm_features)
        self._pending[request_id] = _Pending(name, bos, seed, chosen, grids, stream_audio=bool(stream_audio))

    def _talker_params(self, overrides: TalkerParams | dict[str, Any] | None) -> TalkerParams:
        """The defaults with ``overrides`` (a dict or a ``TalkerParams``) in place, but for
        ``suppress_token_ids``, which extend the defaults' (those keep the talker off codes
        the vocoder cannot decode); a ``max_tokens`` past ``talker_max_tokens`` is refused."""
        defaults = self.default_talker_params
        assert defaults is not None and self.talker_max_tokens is not None
        if isinstance(overrides, TalkerParams):
            overrides = dataclasses.asdict(overrides)
        params = defaults.replace(**overrides) if overrides else defaults
        if params.max_tokens > self.talker_max_tokens:
            raise ValueError(
                f"talker_params.max_tokens={params.max_tokens} exceeds {self.talker_max_tokens}, what the talker's "
                f"context (talker_max_model_len={self.stages['talker'].max_model_len}) was sized for; build the "
                f"engine with a larger talker_params max_tokens or talker_max_model_len"
            )
        return params

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Drop requests wherever they are; their blocks, rows and queued work are freed."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for stage in self.stages.values():
            stage.abort_request(ids)
        for rid in ids:
            self._pending.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._pending) or any(s.has_unfinished_requests() for s in self.stages.values())

    # -- the loop ------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        progress: list[RequestOutput] = []
        done: list[RequestOutput] = []
        for name, stage in self.stages.items():
            if not stage.has_unfinished_requests():
                continue
            for out in stage.step():
                pending = self._pending.get(out.request_id)
                if pending is None:
                    continue  # aborted meanwhile
                try:
                    self._advance(name, out, pending, progress, done)
                except Exception as exc:  # noqa: BLE001 - a failed hand-off fails its request alone
                    out.error = (f"request {out.request_id!r}: handing it on from the {name} stage failed "
                                 f"({type(exc).__name__}: {exc})")  # fmt: skip
                    self._fail(out, pending, done)
        # Filtered last: requests aborted or completed during this step are not in progress.
        return [out for out in progress if out.request_id in self._pending] + done

    def _advance(
        self, name: str, out: RequestOutput, pending: _Pending, progress: list[RequestOutput], done: list[RequestOutput]
    ) -> None:
        """Take one output of stage ``name``: report it, hand it to the next stage, or complete it."""
        if out.error is not None:  # failed in this stage: it fails alone, everywhere
            self._fail(out, pending, done)
        elif name == "thinker":
            if out.finished:
                self._thinker_finished(out, pending, done)
            if out.request_id in self._pending:  # text still streaming, or audio to come
                progress.append(out if not out.finished else _still_running(out))
        elif name == "talker":
            self._talker_codes(out, pending)
        else:
            self._vocoded(out, pending, progress, done)

    def _thinker_finished(self, out: RequestOutput, pending: _Pending, done: list[RequestOutput]) -> None:
        rid = out.request_id
        states = out.multimodal_output.pop("hidden_states", None)
        pending.output = out
        if pending.talker_params is None:
            del self._pending[rid]
            done.append(out)
            return
        prompt_ids, output_ids = list(out.prompt_token_ids), list(out.outputs[0].token_ids)
        if len(output_ids) < 2:  # the talker has nothing to condition on
            self._finish(rid, [], done)
            return
        expected = len(prompt_ids) + len(output_ids) - 1
        got = 0 if states is None else states.shape[0]
        if got != expected:
            # A prefix hit without its cached rows (or a lost step) would give the
            # talker a truncated conditioning: never hand that on silently.
            cache_on = self.thinker.runner.tensor_cache is not None  # type: ignore[union-attr]
            raise RuntimeError(
                f"thinker request {rid!r}: collected {got} per-token rows for the talker, expected "
                f"{expected} (prompt {len(prompt_ids)} + generated {len(output_ids)} - 1); "
                f"tensor prefix cache {'on' if cache_on else 'off'}"
            )
        handoff = ThinkerOutputForTalker(rid, prompt_ids, output_ids, states, **pending.grids)
        talker = self.stages["talker"]
        tp = pending.talker_params
        request = TalkerRequest(handoff, pending.speaker, pending.speaker_bos_token_id, pending.seed, tp)
        inputs = talker.process_inputs(rid, request)
        pending.talker_state = inputs.payload
        room = talker.max_model_len - len(inputs.prompt_token_ids)
        if room < 1:
            raise ValueError(
                f"talker request {rid!r}: its prompt of {len(inputs.prompt_token_ids)} rows leaves no room in the "
                f"talker's max_model_len={talker.max_model_len}"
            )
        # Room is short of max_tokens only where the operator sized the talker's context
        # below the default max_tokens (talker_max_model_len, or the talker's positions).
        talker.add_request(rid, inputs, tp.sampling_params(seed=pending.seed, max_tokens=min(tp.max_tokens, room)))

    def _talker_codes(self, out: RequestOutput, pending: _Pending) -> None:
        """Hand the talker's codes so far to the vocoder stage (adding the request
        there once its first chunk is ready, or when the codes are final)."""
        completion = out.outputs[0]
        codes = list(completion.token_ids)
        if out.finished:
            stops = pending.talker_params.stop_token_ids if pending.talker_params else ()
            if completion.finish_reason == "stop" and codes and codes[-1] in stops:
                codes.pop()  # the stop code is not audio
            pending.codes = codes
        units: list[Any] = codes  # what the vocoder decodes
        frames = getattr(pending.talker_state, "frames", None)
        if frames is not None:
            # Qwen3-Omni: whole frames (every code group). The last sampled code's frame is
            # never audio (transformers never predicts its residual codes): a frame is final
            # once a later code exists, and at the end the vocoder gets len(codes) - 1 frames.
            units = [list(f) for f in frames[: max(0, len(completion.token_ids) - 1)]]
            if out.finished:
                pending.frames = units
        vocoder = self.stages["token2wav"]
        rid = out.request_id
        self._check_codebook(units, pending)
        if not pending.vocoding:
            if not out.finished and not self.vocoder_schedule(pending.stream_audio).num_ready(len(units), False):
                return
            request = Token2WavRequest(rid, units, pending.speaker, pending.seed, stream=pending.stream_audio)
            vocoder.add_request(rid, request)
            pending.vocoding = True
        vocoder.extend_request(rid, units, final=out.finished)

    def _check_codebook(self, units: list[Any], pending: _Pending) -> None:
        """Refuse codes past the vocoder's codebook (control ids the talker was let sample)
        here, where they fail their request alone, not the vocoder's batch of requests."""
        size = getattr(self.stages["token2wav"].loaded_model.model, "codebook_size", None)
        if size is None:
            return
        for i in range(pending.units_checked, len(units)):
            unit = units[i]
            for code in unit if isinstance(unit, list) else (unit,):
                if not 0 <= code < size:
                    raise ValueError(
                        f"the talker made code {code} (frame {i}), outside the vocoder's codebook [0, {size}); "
                        f"talker_params.suppress_token_ids must keep the talker off such ids"
                    )
        pending.units_checked = len(units)

    def vocoder_schedule(self, stream: bool) -> ChunkSchedule:
        """The vocoder's chunk schedule for a streamed (or whole) decode."""
        return self.stages["token2wav"].loaded_model.model.chunk_schedule(stream)

    def _vocoded(self, out: RequestOutput, pending: _Pending, progress: list[RequestOutput], done: list[RequestOutput]) -> None:
        """A chunk of audio: reported as progress, or, the last, completing the request."""
        chunk = out.multimodal_output["audio"]
        if chunk.dtype != np.float32 or chunk.ndim != 1:
            raise RuntimeError(f"request {out.request_id!r}: the vocoder gave {chunk.dtype} {chunk.shape}, expected 1-D float32")
        pending.audio_chunks.append(chunk)
        assert pending.output is not None
        if len(pending.audio_chunks) == 1:
            pending.output.extra["first_audio_time"] = time.monotonic()
        if out.finished:
            self._finish(out.request_id, pending.audio_chunks, done)
        else:
            running = _still_running(pending.output)
            running.audio_chunks, running.sample_rate = list(pending.audio_chunks), self.sample_rate
            progress.append(running)

    def _fail(self, out: RequestOutput, pending: _Pending, done: list[RequestOutput]) -> None:
        final = pending.output or out  # a later stage's failure ends the thinker's finished output
        final.error = out.error
        self.abort_request(out.request_id)
        done.append(final)

    def _finish(self, rid: str, chunks: list[np.ndarray], done: list[RequestOutput]) -> None:
        pending = self._pending.pop(rid)
        out = pending.output
        assert out is not None
        audio = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)
        out.audio, out.audio_chunks, out.sample_rate = audio, list(chunks), self.sample_rate
        out.extra["codec_token_ids"] = list(pending.codes or [])
        if pending.frames is not None:
            out.extra["codec_frames"] = pending.frames
        out.extra["audio_time"] = time.monotonic()  # vs. out.metrics.arrival_time: time to audio
        done.append(out)


def _still_running(out: RequestOutput) -> RequestOutput:
    """A thinker output as progress of a request the pipeline has not completed.

    It is copied, not edited, because the pipeline later completes that same
    object with the audio."""
    outputs = [dataclasses.replace(c, finish_reason=None, stop_reason=None) for c in out.outputs]
    return dataclasses.replace(out, finished=False, outputs=outputs)


def _grid_fields(features: list[MultiModalFeatureSpec]) -> dict[str, torch.Tensor | None]:
    """``ThinkerOutputForTalker``'s grid fields, gathered as the thinker adapter does for its positions."""

    def gather(modality: str, key: str) -> torch.Tensor | None:
        values = [f.data[key] for f in features if f.modality == modality and f.data is not None]
        return torch.cat(values) if values else None

    return {
        "image_grid_thw": gather("image", "image_grid_thw"),
        "video_grid_thw": gather("video", "video_grid_thw"),
        "audio_seqlens": gather("audio", "audio_feature_lengths"),
        "second_per_grids": gather("video", "second_per_grid_ts"),
    }
