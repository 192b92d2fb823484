"""Worker-side store of encoder outputs and of each request's multimodal items."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from omnistage.multimodal.inputs import MultiModalFeatureSpec

__all__ = ["EncoderCache", "FeatureEntry", "RequestFeatureIndex"]


class FeatureEntry(NamedTuple):
    """What the gather needs of one item, as plain Python values."""

    offset: int
    length: int
    identifier: str
    modality: str
    embeds_cumsum: list[int] | None  # None: every position is an embed
    is_embed: np.ndarray | None  # bool mask as NumPy, for the CPU mask write
    num_embeds: int
    end: int  # offset + length


class RequestFeatureIndex:
    """A request's items laid out for window search by bisection.

    ``offsets[k]`` is item k's first position and ``max_ends[k]`` the largest
    end among items ``0..k``. Both are sorted, so the items overlapping
    ``[start, end)`` lie in ``range(bisect_right(max_ends, start),
    bisect_left(offsets, end))``. The running maximum keeps the search correct
    for items that share placeholders (one span nested in another); for the
    usual disjoint items it equals the plain ends.

    ``embed_positions`` holds one byte (0 or 1) per prompt position from 0 to
    at least ``max_end``: 1 where some item places an encoder row (the OR of
    every item's ``is_embed``); the gather pads it with zeros on demand. A step's slot mask is then the join of one bytes
    slice per request, not one array write per item.
    """

    __slots__ = ("embed_positions", "entries", "features", "max_ends", "num_features", "offsets")

    def __init__(self, req_id: str, features: Sequence[MultiModalFeatureSpec]) -> None:
        self.features = features
        self.num_features = len(features)
        self.offsets: list[int] = []
        self.max_ends: list[int] = []
        self.entries: list[FeatureEntry] = []
        max_end = 0
        for k, feature in enumerate(features):
            if not isinstance(feature, MultiModalFeatureSpec):
                raise ValueError(
                    f"request {req_id}: mm_features[{k}]: expected a "
                    f"MultiModalFeatureSpec, got {type(feature).__name__}"
                )
            pos = feature.mm_position
            if self.offsets and pos.offset < self.offsets[-1]:
                raise ValueError(
                    f"request {req_id}: mm_features must be sorted by placeholder "
                    f"offset; item {k} ({feature.identifier}) starts at {pos.offset}, "
                    f"expected >= {self.offsets[-1]} (the offset of item {k - 1})"
                )
            cumsum = pos.embeds_cumsum
            mask = None if pos.is_embed is None else pos.is_embed.detach().cpu().numpy()
            max_end = max(max_end, pos.offset + pos.length)
            self.offsets.append(pos.offset)
            self.max_ends.append(max_end)
            self.entries.append(
                FeatureEntry(
                    pos.offset,
                    pos.length,
                    feature.identifier,
                    feature.modality,
                    cumsum,
                    mask,
                    pos.get_num_embeds(),
                    pos.offset + pos.length,
                )
            )
        positions = np.zeros(max_end, dtype=bool)
        for entry in self.entries:
            span = positions[entry.offset : entry.end]
            if entry.is_embed is None:
                span[:] = True
            else:
                span |= entry.is_embed
        self.embed_positions = positions.tobytes()

    def is_current(self, features: Sequence[MultiModalFeatureSpec]) -> bool:
        return self.features is features and self.num_features == len(features)


class EncoderCache:
    """Encoder outputs keyed by content hash, plus each request's item list.

    Policy:

    * ``encoder_outputs`` maps an item's ``identifier`` (its content hash) to its
      encoder output, a tensor ``[num_embeds, hidden]``. It is keyed by content,
      not by request, so two requests holding the same image share one entry.
    * Lifetime belongs to the scheduler's ``EncoderCacheManager``: it counts
      references per hash, evicts unreferenced entries oldest first, and sends
      the evicted hashes to the worker, which frees them here at the start of
      the next step (``free_encoder_cache``). Removing a request never frees an
      output, because another request may still read it.
    * A hit guarantees the stored tensor is the output for that content; the
      gather additionally checks its row count against the item's
      ``get_num_embeds()`` before using it.
    * ``mm_features`` maps a request id to its items, sorted by placeholder
      offset. Registered lists are treated as immutable: to change a request's
      items, register a new list (``add_request``). Assigning into
      ``mm_features`` directly also works; the search index is then built on
      first use.
    """

    def __init__(self) -> None:
        self.mm_features: dict[str, list[MultiModalFeatureSpec]] = {}
        self.encoder_outputs: dict[str, torch.Tensor] = {}
        self.feature_indices: dict[str, RequestFeatureIndex] = {}

    def add_request(self, req_id: str, mm_features: list[MultiModalFeatureSpec]) -> None:
        """Register (or replace) a request's items; validates their order."""
        index = RequestFeatureIndex(req_id, mm_features)
        self.mm_features[req_id] = mm_features
        self.feature_indices[req_id] = index

    def remove_request(self, req_id: str) -> None:
        """Forget a request's items. Its encoder outputs stay (they are shared)."""
        self.mm_features.pop(req_id, None)
        self.feature_indices.pop(req_id, None)

    def free_encoder_cache(self, mm_hash: str) -> None:
        """Drop one encoder output; freeing an absent hash is a no-op."""
        self.encoder_outputs.pop(mm_hash, None)

    def reset_encoder_cache(self) -> None:
        """Drop every encoder output (e.g. after a weight update)."""
        self.encoder_outputs.clear()

    def feature_index(self, req_id: str) -> RequestFeatureIndex:
        """The bisection index of a request's items, rebuilt if its list changed."""
        features = self.mm_features.get(req_id)
        if features is None:
            raise RuntimeError(
                f"request {req_id} has no registered multimodal items: expected "
                "EncoderCache.add_request to have been called when it was admitted"
            )
        index = self.feature_indices.get(req_id)
        if index is None or not index.is_current(features):
            index = RequestFeatureIndex(req_id, features)
            self.feature_indices[req_id] = index
        return index

    def __len__(self) -> int:
        return len(self.encoder_outputs)
