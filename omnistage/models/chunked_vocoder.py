"""The seam between a pipeline's vocoder stage and a vocoder that streams.

A vocoder declares how it cuts a request's codes into chunks (a
``ChunkSchedule``: one for streaming, one for a whole decode) and decodes one
chunk at a time from every code known so far. The chunked stage
(``core.chunked_scheduler`` + ``worker.chunked_runner``) asks it for each
chunk as soon as the talker has produced the codes that chunk needs, and the
audio leaves with the chunk. A causal vocoder (Qwen3-Omni's Code2Wav) re-reads
some left context and returns exactly a full decode's samples for the chunk; a
non-causal one (Qwen2.5-Omni's DiT) approximates its full decode (see its
``decode_chunk``).

A vocoder that can decode several requests' chunks in one forward exactly
(a causal one, right-padded) also defines ``decode_chunks(calls)``; the stage
then hands it every chunk it scheduled in a step (``decode_scheduled``). One
that cannot (its noise or block-local attention is per request) is called
once per chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from omnistage.core.chunk_schedule import ChunkSchedule

__all__ = ["ChunkCall", "ChunkedVocoder", "decode_in_chunks", "decode_scheduled"]


@runtime_checkable
class ChunkedVocoder(Protocol):
    """Codes -> waveform, one chunk at a time.

    - ``chunk_schedule(stream)``: the schedule of a streamed request
      (``stream=True``) or of a whole decode (``ChunkSchedule()``: one chunk
      once the codes are final).
    - ``start_decode(speaker, seed, stream)``: a request's decode state (its
      noise, the tails of earlier chunks: whatever later chunks need); the
      runner keeps it between chunks and drops it after the last.
    - ``decode_chunk(codes, index, state, last)``: the samples (1-D float32)
      of chunk ``index``, given every code so far; ``last`` says the codes are
      final and this chunk ends them. Chunks are asked for in order, each once.

    A vocoder that embeds codes from a fixed codebook may also declare
    ``codebook_size``: the pipeline then fails a request whose codes fall
    outside ``[0, codebook_size)`` before they reach a (batched) decode.
    """

    sample_rate: int

    def chunk_schedule(self, stream: bool) -> ChunkSchedule: ...

    def start_decode(self, speaker: str, seed: int, stream: bool) -> Any: ...

    def decode_chunk(self, codes: Sequence[int], index: int, state: Any, last: bool) -> np.ndarray: ...


@dataclass(frozen=True)
class ChunkCall:
    """One ``decode_chunk`` call: a request's codes so far, the chunk's index, its decode state, last or not."""

    codes: Sequence[Any]
    index: int
    state: Any
    last: bool


def decode_scheduled(vocoder: ChunkedVocoder, calls: Sequence[ChunkCall]) -> list[np.ndarray]:
    """Each call's samples: in one ``decode_chunks(calls)`` when the vocoder batches
    (it must return what ``decode_chunk`` would, per call), else one call at a time."""
    batched = getattr(vocoder, "decode_chunks", None)
    if batched is not None and len(calls) > 1:
        return list(batched(calls))
    return [vocoder.decode_chunk(c.codes, c.index, c.state, c.last) for c in calls]


def decode_in_chunks(
    vocoder: ChunkedVocoder, codes: Sequence[int], speaker: str, seed: int, stream: bool = True
) -> list[np.ndarray]:
    """The chunks a stage would emit for ``codes`` arriving one by one: each
    chunk is decoded as soon as it is ready (so it sees only the codes known
    then), and the rest once the codes are final."""
    schedule = vocoder.chunk_schedule(stream)
    state = vocoder.start_decode(speaker, seed, stream)
    chunks: list[np.ndarray] = []
    for known in range(1, len(codes) + 1):
        while schedule.num_ready(known, False) > len(chunks):
            chunks.append(vocoder.decode_chunk(codes[:known], len(chunks), state, last=False))
    total = schedule.num_ready(len(codes), True)
    while len(chunks) < total:
        chunks.append(vocoder.decode_chunk(codes, len(chunks), state, last=len(chunks) + 1 == total))
    return chunks
