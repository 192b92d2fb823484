"""thinker -> talker -> token2wav: requests move on as soon as a stage is done with them."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from omnistage.engine.llm_engine import PromptType
from omnistage.engine.omni.stage_io import TalkerRequest, resolve_speaker
from omnistage.engine.omni.talker_stage import TalkerParams, TalkerStage
from omnistage.engine.omni.thinker_stage import ThinkerResult, ThinkerStage
from omnistage.engine.omni.token2wav_stage import Token2WavStage
from omnistage.outputs import RequestOutput
from omnistage.sampling_params import SamplingParams

__all__ = ["OmniPipeline"]


@dataclass
class _Pending:
    """A request between the thinker's answer and its audio."""

    speaker: str
    speaker_bos_token_id: int
    seed: int
    talker_params: TalkerParams | None  # None: no audio asked
    output: RequestOutput | None = None  # the thinker's, once finished
    codes: list[int] | None = None  # the talker's, once finished


class OmniPipeline:
    """Three stages, each batching on its own, stepped in turn by ``step()``.

    A request that the thinker finishes this step enters the talker in the same
    step, and likewise from the talker to token2wav. Stages exchange plain CPU
    records and never call one another. ``step()`` returns the requests that
    are complete: a ``RequestOutput`` with the thinker's text, plus ``audio``
    (1-D float32) and ``sample_rate`` when audio was asked for.

    Seeds: a request's seed is ``SamplingParams.seed``, or the pipeline's
    ``seed`` when that is None. It drives the talker's sampling and token2wav's
    initial noise, which is then the noise transformers draws right after
    ``torch.manual_seed(seed)``.

    Streaming: after ``step()``, ``progress`` holds the thinker's cumulative
    outputs from that step for requests the pipeline still holds: those still
    generating text, and those whose text is done (``finished`` is the
    thinker's) while their audio is not. ``step()`` itself returns only
    complete requests.
    """

    def __init__(
        self,
        thinker: ThinkerStage,
        talker: TalkerStage | None,
        token2wav: Token2WavStage | None,
        speakers: dict[str, dict],
        default_talker_params: TalkerParams | None,
        seed: int = 0,
    ) -> None:
        self.thinker = thinker
        self.talker = talker
        self.token2wav = token2wav
        self.speakers = speakers
        self.default_talker_params = default_talker_params
        self.seed = seed
        self._pending: dict[str, _Pending] = {}
        self.progress: list[RequestOutput] = []

    @property
    def has_audio_output(self) -> bool:
        return self.talker is not None and self.token2wav is not None

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        return_audio: bool = True,
        speaker: str | None = None,
        talker_params: TalkerParams | None = None,
    ) -> None:
        """Queue a request. Raises ValueError, queuing nothing, when it cannot run."""
        params = SamplingParams() if params is None else params
        if request_id in self._pending:
            raise ValueError(f"request {request_id!r}: a request with this id is already running")
        if return_audio and not self.has_audio_output:
            raise ValueError("this checkpoint has no talker and token2wav, so it cannot return audio")
        name, bos = "", -1
        if return_audio:
            name = resolve_speaker(speaker, self.speakers)
            bos = int(self.speakers[name]["bos_token"])
        self.thinker.add_request(request_id, prompt, params, feeds_talker=return_audio)
        seed = self.seed if params.seed is None else params.seed
        chosen = (talker_params or self.default_talker_params) if return_audio else None
        self._pending[request_id] = _Pending(name, bos, seed, chosen)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Drop requests wherever they are; their blocks, rows and queued work are freed."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.thinker.abort_request(ids)
        if self.talker is not None:
            self.talker.abort_request(ids)
        if self.token2wav is not None:
            self.token2wav.abort_request(ids)
        for rid in ids:
            self._pending.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._pending) or any(
            s.has_unfinished_requests() for s in (self.thinker, self.talker, self.token2wav) if s is not None
        )

    def held(self) -> dict[str, int]:
        """Per-stage counts of what requests still hold (KV blocks, batch rows,
        collected or staged tensors, encoder references, queued work); every
        count is zero once all requests finished or were aborted and the stages
        stepped once more to drop their batch rows."""
        counts = {"pipeline_requests": len(self._pending)}
        for stage in (self.thinker, self.talker, self.token2wav):
            if stage is not None:
                counts.update(stage.held())
        return counts

    def step(self) -> list[RequestOutput]:
        done: list[RequestOutput] = []
        thinker_outs: list[RequestOutput] = []
        if self.thinker.has_unfinished_requests():
            results = self.thinker.step()
            thinker_outs = [*self.thinker.progress, *(r.output for r in results)]
            for result in results:
                self._thinker_finished(result, done)
        if self.talker is not None and self.talker.has_unfinished_requests():
            assert self.token2wav is not None
            for request in self.talker.step():
                pending = self._pending.get(request.request_id)
                if pending is not None:
                    pending.codes = request.codes
                    self.token2wav.add_request(request)
        if self.token2wav is not None and self.token2wav.has_unfinished_requests():
            for audio in self.token2wav.step():
                self._finish(audio.request_id, audio.audio, audio.sample_rate, done)
        # Filtered last: requests aborted or completed during this step are not in progress.
        self.progress = [out for out in thinker_outs if out.request_id in self._pending]
        return done

    def _thinker_finished(self, result: ThinkerResult, done: list[RequestOutput]) -> None:
        rid = result.output.request_id
        pending = self._pending.get(rid)
        if pending is None:
            return  # aborted meanwhile
        pending.output = result.output
        if pending.talker_params is None:
            self._pending.pop(rid)
            done.append(result.output)
        elif result.handoff is None:  # fewer than 2 thinker tokens: nothing to speak
            rate = self.token2wav.sample_rate  # type: ignore[union-attr]
            self._finish(rid, np.zeros(0, dtype=np.float32), rate, done)
        else:
            request = TalkerRequest(
                result.handoff, pending.speaker, pending.speaker_bos_token_id, pending.seed,
                max_codes=pending.talker_params.max_tokens,
            )  # fmt: skip
            self.talker.add_request(request, pending.talker_params)  # type: ignore[union-attr]

    def _finish(self, rid: str, audio: np.ndarray, sample_rate: int, done: list[RequestOutput]) -> None:
        pending = self._pending.pop(rid, None)
        if pending is None or pending.output is None:
            return
        out = pending.output
        out.audio, out.sample_rate = audio, int(sample_rate)
        out.extra["codec_token_ids"] = list(pending.codes or [])
        out.extra["audio_time"] = time.monotonic()  # vs. out.metrics.arrival_time: time to audio
        done.append(out)
