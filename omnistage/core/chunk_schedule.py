"""Which codes a streaming vocoder decodes together: its chunk schedule.

Pure bookkeeping over code counts, so the scheduler (``core``) and the models
that declare a schedule share it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ChunkSchedule"]


@dataclass(frozen=True)
class ChunkSchedule:
    """Chunk ``i`` emits the audio of codes ``[end(i-1), end(i))``, where
    ``end(i) = first + i * size``; the last chunk ends at the last code.

    - ``first=None``: one chunk, decoded once the codes are final (a full decode).
    - ``lookahead``: codes past a chunk's end that its decode reads (right
      context). A chunk that is not the last is decoded once the producer has
      more than ``end(i) + lookahead - 1`` codes, i.e. at least
      ``end(i) + max(lookahead, 1)``: so a chunk decoded before the codes were
      final is never the last one, and its span cannot change afterwards.

    Left context (codes before the chunk that its decode re-reads) is the
    vocoder's business: it gets every code so far.
    """

    first: int | None = None
    size: int = 0
    lookahead: int = 0

    def __post_init__(self) -> None:
        if self.first is not None and (self.first < 1 or self.size < 1):
            raise ValueError(f"chunk sizes must be >= 1, got first={self.first}, size={self.size}")
        if self.lookahead < 0:
            raise ValueError(f"lookahead must be >= 0, got {self.lookahead}")

    @property
    def streams(self) -> bool:
        return self.first is not None

    def end(self, index: int) -> int:
        """Where chunk ``index`` ends when it is not the last."""
        assert self.first is not None
        return self.first + index * self.size

    def num_ready(self, num_codes: int, final: bool) -> int:
        """How many chunks can be decoded with ``num_codes`` codes known
        (``final``: no more will come). No codes at all make no chunk."""
        if num_codes <= 0:
            return 0
        if self.first is None:
            return 1 if final else 0
        if final:  # every boundary before the end, then the last chunk
            return max(0, -(-(num_codes - self.first) // self.size)) + 1
        room = num_codes - max(self.lookahead, 1) - self.first
        return 0 if room < 0 else room // self.size + 1

    def span(self, index: int, num_codes: int, last: bool) -> tuple[int, int]:
        """``[start, end)`` of the codes chunk ``index`` emits."""
        if self.first is None:
            return 0, num_codes
        start = 0 if index == 0 else self.end(index - 1)
        return start, num_codes if last else self.end(index)
