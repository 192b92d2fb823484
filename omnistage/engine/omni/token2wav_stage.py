"""The token2wav stage: codec tokens to waveforms, first come first served."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from omnistage.engine.omni.stage_io import AudioOutput, Token2WavRequest
from omnistage.models.qwen2_5_omni_token2wav import Qwen2_5OmniToken2Wav

__all__ = ["Token2WavStage"]


class Token2WavStage:
    """A batch stage with no KV cache and no autoregression.

    Each step decodes up to ``max_requests_per_step`` queued requests, oldest
    first, one at a time. The DiT's block-local attention means padding would
    change results, so requests are not padded into one batch. A small number
    per step keeps the thinker and talker stepping between waveforms. Each
    request's initial noise comes from its own seed (``Qwen2_5OmniToken2Wav``),
    so its audio does not depend on what ran before it.
    """

    def __init__(self, token2wav: Qwen2_5OmniToken2Wav, max_requests_per_step: int = 1) -> None:
        if max_requests_per_step < 1:
            raise ValueError(f"max_requests_per_step must be >= 1, got {max_requests_per_step}")
        self.token2wav = token2wav
        self.max_requests_per_step = max_requests_per_step
        self._queue: OrderedDict[str, Token2WavRequest] = OrderedDict()

    @property
    def sample_rate(self) -> int:
        return int(self.token2wav.sample_rate)

    @property
    def num_requests(self) -> int:
        return len(self._queue)

    def add_request(self, request: Token2WavRequest) -> None:
        if request.request_id in self._queue:
            raise ValueError(f"token2wav request {request.request_id!r} is already queued")
        if request.speaker not in self.token2wav.speakers:
            raise ValueError(f"token2wav request {request.request_id!r}: unknown speaker {request.speaker!r}")
        self._queue[request.request_id] = request

    def abort_request(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._queue.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._queue)

    def held(self) -> dict[str, int]:
        return {"token2wav_requests": len(self._queue)}

    def step(self) -> list[AudioOutput]:
        done = []
        for _ in range(min(self.max_requests_per_step, len(self._queue))):
            _, request = self._queue.popitem(last=False)
            wave = self.token2wav(request.codes, request.speaker, seed=request.seed)
            done.append(AudioOutput(request.request_id, wave, self.sample_rate))
        return done
