"""The runner of a chunked stage: each scheduled chunk through a streaming vocoder."""

from __future__ import annotations

from typing import Any

import torch

from omnistage.core.runner_output import ModelRunnerOutput
from omnistage.core.sched_output import SchedulerOutput
from omnistage.models.chunked_vocoder import ChunkCall, ChunkedVocoder, decode_scheduled

__all__ = ["ChunkedRunner"]


class ChunkedRunner:
    """``ModelRunner``'s interface for a ``ChunkedVocoder``.

    Per request it keeps the vocoder's decode state (``start_decode`` on its
    first chunk; e.g. its noise and the previous chunk's tail) from one chunk
    to the next, and drops it with the last chunk or when the request is
    aborted. A step's chunks (at most one per request) go to the vocoder
    together (``decode_scheduled``): in one batch when it declares
    ``decode_chunks`` (exact for a causal vocoder), else one at a time.
    Outputs: ``{"audio": this chunk's samples (1-D float32), "chunk_index": i,
    "last": bool}`` per request in ``multimodal_outputs``.
    """

    def __init__(self, model: ChunkedVocoder) -> None:
        self.model = model
        self.states: dict[str, Any] = {}

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids:
            self.states.pop(rid, None)
        calls = []
        for chunk in so.scheduled_chunks:
            state = self.states.get(chunk.req_id)
            if state is None:
                payload = chunk.payload
                state = self.model.start_decode(payload.speaker, payload.seed, payload.stream)
                self.states[chunk.req_id] = state
            calls.append(ChunkCall(chunk.codes, chunk.index, state, chunk.last))
        audios = decode_scheduled(self.model, calls)
        outputs: dict[str, dict[str, object]] = {}
        for chunk, audio in zip(so.scheduled_chunks, audios, strict=True):
            if chunk.last:
                del self.states[chunk.req_id]
            outputs[chunk.req_id] = {"audio": audio, "chunk_index": chunk.index, "last": chunk.last}
        return ModelRunnerOutput(req_ids=list(outputs), multimodal_outputs=outputs)

    def forget(self, req_ids: list[str]) -> None:
        for rid in req_ids:
            self.states.pop(rid, None)

    @property
    def num_rows(self) -> int:
        return 0  # nothing is owed a step: states go with the last chunk or the abort

    @property
    def num_payloads(self) -> int:
        return len(self.states)
