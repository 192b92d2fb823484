"""Data types that describe the multimodal items of a request.

A request's prompt holds one run of placeholder tokens per image / audio clip /
video; ``PlaceholderRange`` says where that run lies and which of its positions
receive an encoder embedding, and ``MultiModalFeatureSpec`` ties it to the
processed encoder inputs and to the content hash that keys the encoder cache.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = [
    "MultiModalFeatureSpec",
    "PlaceholderRange",
    "get_mm_features_in_window",
]


def _as_count(owner: str, name: str, value: Any) -> int:
    """Return ``value`` as a Python int >= 0, or raise a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(
            f"{owner}.{name}: expected a non-negative int, "
            f"got {type(value).__name__} {value!r}"
        )
    if value < 0:
        raise ValueError(f"{owner}.{name}: expected a non-negative int, got {value}")
    return int(value)


@dataclass(frozen=True)
class PlaceholderRange:
    """The placeholder span of one multimodal item inside a prompt.

    ``offset`` is the prompt position of the first placeholder token and
    ``length`` the number of placeholder tokens. ``is_embed`` is an optional bool
    mask of shape ``(length,)``: True positions receive a row of the item's
    encoder output, in order; False positions (break or text tokens inside the
    span) keep their token embedding. ``None`` means every position is an embed
    position, so the encoder output has ``length`` rows.

    Example: ``offset=2, length=5, is_embed=[F, T, F, T, T]`` has 3 embeds; the
    relative window ``[3, 5)`` (prompt positions 5..6) reads rows ``[1, 3)``.
    """

    offset: int
    length: int
    is_embed: torch.Tensor | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "offset", _as_count("PlaceholderRange", "offset", self.offset))
        object.__setattr__(self, "length", _as_count("PlaceholderRange", "length", self.length))
        mask = self.is_embed
        if mask is None:
            return
        if not isinstance(mask, torch.Tensor):
            raise ValueError(
                "PlaceholderRange.is_embed: expected a torch.bool tensor of shape "
                f"({self.length},) or None, got {type(mask).__name__}"
            )
        if mask.dtype != torch.bool:
            raise ValueError(
                f"PlaceholderRange.is_embed: expected dtype torch.bool, got {mask.dtype}"
            )
        if mask.ndim != 1 or mask.shape[0] != self.length:
            raise ValueError(
                f"PlaceholderRange.is_embed: expected shape ({self.length},) to match "
                f"length={self.length}, got {tuple(mask.shape)}"
            )

    @functools.cached_property
    def embeds_cumsum(self) -> list[int] | None:
        """Inclusive running count of embed positions, as a Python list
        (indexing a list is far cheaper than indexing a tensor); None without
        a mask."""
        if self.is_embed is None:
            return None
        return torch.cumsum(self.is_embed.detach().to("cpu", torch.int64), 0).tolist()

    def get_num_embeds(self) -> int:
        """Number of encoder-output rows this item has."""
        cumsum = self.embeds_cumsum
        if cumsum is None:
            return self.length
        return cumsum[-1] if cumsum else 0

    def get_embeds_indices_in_range(self, start_idx: int, end_idx: int) -> tuple[int, int]:
        """Map the relative placeholder window ``[start_idx, end_idx)`` to the
        row range ``[start, end)`` of the encoder output it covers."""
        if not 0 <= start_idx <= end_idx <= self.length:
            raise ValueError(
                f"PlaceholderRange.get_embeds_indices_in_range: expected "
                f"0 <= start_idx <= end_idx <= length={self.length}, "
                f"got ({start_idx}, {end_idx})"
            )
        cumsum = self.embeds_cumsum
        if cumsum is None:
            return start_idx, end_idx
        start = cumsum[start_idx - 1] if start_idx > 0 else 0
        end = cumsum[end_idx - 1] if end_idx > 0 else 0
        return start, end

    def extract_embeds_range(self) -> list[tuple[int, int]]:
        """Absolute ``(start, end_inclusive)`` prompt positions of each run of
        embed positions."""
        if self.is_embed is None:
            if self.length == 0:
                return []
            return [(self.offset, self.offset + self.length - 1)]
        mask = self.is_embed.detach().to("cpu").numpy().astype(np.int8)
        edges = np.diff(np.concatenate(([0], mask, [0])))
        starts = np.flatnonzero(edges == 1)
        ends = np.flatnonzero(edges == -1) - 1
        return [(self.offset + int(s), self.offset + int(e)) for s, e in zip(starts, ends)]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PlaceholderRange):
            return NotImplemented
        if (self.offset, self.length) != (other.offset, other.length):
            return False
        if self.is_embed is None or other.is_embed is None:
            return self.is_embed is None and other.is_embed is None
        return torch.equal(self.is_embed.cpu(), other.is_embed.cpu())

    def __hash__(self) -> int:
        return hash((self.offset, self.length))


@dataclass(eq=False)
class MultiModalFeatureSpec:
    """One multimodal item of a request.

    ``identifier`` is the encoder-cache key: the content hash of the item (with
    a LoRA prefix where one applies). Two items with equal identifiers share
    one encoder output. ``mm_hash`` is the processor-cache key. ``data`` holds
    the processed encoder inputs; it may be None when the item need not be sent
    again (its encoder output is cached), and such items are never encoded.
    """

    data: Any
    modality: str
    identifier: str
    mm_position: PlaceholderRange
    mm_hash: str | None = None

    def __post_init__(self) -> None:
        for name in ("modality", "identifier"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(
                    f"MultiModalFeatureSpec.{name}: expected a non-empty str, "
                    f"got {type(value).__name__} {value!r}"
                )
        if not isinstance(self.mm_position, PlaceholderRange):
            raise ValueError(
                "MultiModalFeatureSpec.mm_position: expected a PlaceholderRange, "
                f"got {type(self.mm_position).__name__}"
            )
        if self.mm_hash is not None and not isinstance(self.mm_hash, str):
            raise ValueError(
                "MultiModalFeatureSpec.mm_hash: expected a str or None, "
                f"got {type(self.mm_hash).__name__}"
            )


def _feature_end(feature: MultiModalFeatureSpec) -> int:
    return feature.mm_position.offset + feature.mm_position.length


def _feature_offset(feature: MultiModalFeatureSpec) -> int:
    return feature.mm_position.offset


def get_mm_features_in_window(
    features: Sequence[MultiModalFeatureSpec], start: int, end: int
) -> tuple[int, int]:
    """Return ``(lo, hi)`` such that ``features[lo:hi]`` are exactly the items
    whose placeholder span overlaps the prompt window ``[start, end)``.

    ``features`` must be sorted by offset and by end (non-nested spans), as the
    input processor orders them. Two binary searches: ``lo`` is the first item
    ending after ``start``, ``hi`` the first starting at or after ``end``.
    Nothing overlaps when ``lo >= hi``.
    """
    lo = bisect.bisect_right(features, start, key=_feature_end)
    hi = bisect.bisect_left(features, end, key=_feature_offset)
    return lo, hi
