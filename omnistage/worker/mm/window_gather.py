"""The encoder rows a step's prompt windows consume, and the slots they fill.

Cost model (measured in ``benchmarks/bench_gather_cases.py``): a step's result
is one row span per (request, item) pair, held by a ``GatheredRows``. Making a
tensor view per item and giving it a ``.modality`` (about 0.35 us for an
alias, 0.9 us for a slice, plus the attribute) cost more than everything else
together, so views are made only when elements are read, and the merge copies
from the cached outputs themselves (slicing only partial items). The rest:
the per-request work runs as C-level passes (``map`` over the requests'
indices for the two bisections and the slice of each item list); the
per-item loop does one cache lookup, one row-count check and one tuple; and
the slot mask is not written item by item but joined from one bytes slice
per request of the prompt's precomputed embed positions.
NumPy over all items was tried for the window arithmetic and lost: turning
the items' Python ints into arrays costs as much as the arithmetic it saves.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterator, Sequence
from itertools import accumulate
from operator import attrgetter, getitem, is_

import numpy as np
import torch

from omnistage.worker.mm.encoder_cache import (
    EncoderCache,
    FeatureEntry,
    RequestFeatureIndex,
)

__all__ = ["GatheredRows", "gather_windows"]

_FEATURES = attrgetter("features")
_NUM_FEATURES = attrgetter("num_features")
_MAX_ENDS = attrgetter("max_ends")
_OFFSETS = attrgetter("offsets")
_ENTRIES = attrgetter("entries")
_POSITIONS = attrgetter("embed_positions")


class GatheredRows(Sequence[torch.Tensor]):
    """A step's gathered encoder rows, held as ``(output, first row, end row,
    modality)`` spans of the cached outputs (first row ``None``: the whole
    output).

    As a sequence its elements are read-only views, one per span, each with a
    ``.modality`` attribute; they are made on the first element access and
    kept. The merge (``EncoderRunner.get_inputs_embeds``) reads ``tensors()``
    instead: whole items are the cached tensors themselves and only partial
    items are sliced, so the step pays no per-item view and attribute for
    rows it only copies.
    """

    __slots__ = ("_views", "spans")

    def __init__(self, spans: list[tuple[torch.Tensor, int | None, int, str]]) -> None:
        self.spans = spans
        self._views: list[torch.Tensor] | None = None

    def views(self) -> list[torch.Tensor]:
        """One view per span, each carrying its item's ``.modality``."""
        if self._views is None:
            views = []
            with torch.inference_mode():  # cheaper views; they are only read
                for out, rs, re_, modality in self.spans:
                    # detach() makes a fresh alias (to carry the modality) more cheaply than a slice.
                    view = out.detach() if rs is None else out[rs:re_]
                    view.modality = modality
                    views.append(view)
            self._views = views
        return self._views

    def tensors(self) -> list[torch.Tensor]:
        """The rows as plain tensors (cached outputs or slices of them), for copying."""
        with torch.inference_mode():
            return [out if rs is None else out[rs:re_] for out, rs, re_, _ in self.spans]

    @property
    def modalities(self) -> list[str]:
        return [span[3] for span in self.spans]

    @property
    def num_rows(self) -> int:
        return sum(re_ - (rs or 0) for _, rs, re_, _ in self.spans)

    def __len__(self) -> int:
        return len(self.spans)

    def __bool__(self) -> bool:
        return bool(self.spans)

    def __getitem__(self, index):  # type: ignore[override]
        return self.views()[index]

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self.views())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, GatheredRows):
            other = other.views()
        return isinstance(other, (list, tuple)) and self.views() == list(other)

    __hash__ = None  # type: ignore[assignment]


def _current_indices(cache: EncoderCache, req_ids: list[str]) -> list[RequestFeatureIndex]:
    """Each request's search index, rebuilt where its item list was replaced
    or grew (or raising where it has none)."""
    indices = list(map(cache.feature_indices.get, req_ids))
    features = list(map(cache.mm_features.get, req_ids))
    if (
        None in indices
        or not all(map(is_, map(_FEATURES, indices), features))
        or list(map(_NUM_FEATURES, indices)) != list(map(len, features))
    ):
        indices = [cache.feature_index(req_id) for req_id in req_ids]
    return indices


def gather_windows(
    cache: EncoderCache,
    req_ids: list[str],
    starts: list[int],
    counts: list[int],
    slots: list[int],
    num_tokens: int,
    draft_lookahead: int,
) -> tuple[GatheredRows, np.ndarray]:
    """Rows and slot mask for prompt windows ``[starts[n], starts[n] +
    counts[n])`` placed at batch slots from ``slots[n]`` (one entry per
    request in ``req_ids``; slots already checked to lie within
    ``[0, num_tokens)``).

    Returns the rows ordered by request then offset (a ``GatheredRows``: its
    elements are views, each with ``.modality``) and a writable bool array
    ``[num_tokens]``. A missing output raises, except a
    drafter boundary item (starting within ``draft_lookahead`` of the window's
    end), which is skipped; so does a cached output whose row count is not
    the item's ``get_num_embeds()``.
    """
    indices = _current_indices(cache, req_ids)
    ends = list(map(int.__add__, starts, counts))
    lo = list(map(bisect_right, map(_MAX_ENDS, indices), starts))
    hi = list(map(bisect_left, map(_OFFSETS, indices), ends))
    windows = map(getitem, map(_ENTRIES, indices), map(slice, lo, hi))
    outputs = cache.encoder_outputs
    spans: list[tuple[torch.Tensor, int | None, int, str]] = []
    append = spans.append
    skips: list[tuple[int, list[FeatureEntry], list[FeatureEntry]]] = []  # drafter boundary items
    for n, (qs, qe, entries) in enumerate(zip(starts, ends, windows)):
        skipped = None
        for entry in entries:
            off, length, ident, modality, cumsum, _, num_embeds, end = entry
            if off >= qs and end <= qe:  # the whole item is in the window
                if not num_embeds:
                    continue
                rs, re_ = None, num_embeds
            else:
                s = qs - off if qs > off else 0
                e = qe - off if qe < end else length
                if s >= e:  # a span nested in an earlier, longer one
                    continue
                if cumsum is None:
                    rs, re_ = s, e
                else:
                    rs = cumsum[s - 1] if s else 0
                    re_ = cumsum[e - 1]
                    if rs == re_:  # only non-embed positions in the window
                        continue
                if re_ - rs == num_embeds:  # every row of the item
                    rs = None
            try:
                out = outputs[ident]
            except KeyError:
                out = None
            if out is None or out.shape[0] != num_embeds:
                _check_output(out, entry, req_ids[n], qs, qe, rs or 0, re_, draft_lookahead)
                skipped = [entry] if skipped is None else [*skipped, entry]
                continue
            append((out, rs, re_, modality))
        if skipped is not None:
            skips.append((n, indices[n].entries[lo[n] : hi[n]], skipped))
    return GatheredRows(spans), _slot_mask(indices, starts, ends, counts, slots, num_tokens, skips)


def _slot_mask(
    indices: list[RequestFeatureIndex],
    starts: list[int],
    ends: list[int],
    counts: list[int],
    slots: list[int],
    num_tokens: int,
    skips: list[tuple[int, list[FeatureEntry], list[FeatureEntry]]],
) -> np.ndarray:
    """The join of each window's slice of its prompt's embed-position bytes,
    with zero bytes where no window is (decoding requests, gaps)."""
    pieces = list(map(getitem, map(_POSITIONS, indices), map(slice, starts, ends)))
    if list(map(len, pieces)) != counts:  # windows running past their last item
        for n, piece in enumerate(pieces):
            if len(piece) < counts[n]:
                pieces[n] = _padded_positions(indices[n], ends[n])[starts[n] : ends[n]]
    for n, entries, skipped in skips:
        pieces[n] = _unmark(entries, skipped, starts[n], pieces[n])
    if slots[0] == 0 and list(accumulate(counts[:-1], initial=0)) == slots:  # packed windows
        pieces.append(bytes(num_tokens - slots[-1] - counts[-1]))
        return np.frombuffer(bytearray().join(pieces), dtype=bool)
    parts: list[bytes] = []
    cursor = 0  # slots covered by ``parts``
    scattered: list[tuple[int, bytes]] = []  # windows out of slot order
    for slot, piece in zip(slots, pieces):
        if slot >= cursor:
            if slot > cursor:
                parts.append(bytes(slot - cursor))
            parts.append(piece)
            cursor = slot + len(piece)
        else:
            scattered.append((slot, piece))
    parts.append(bytes(num_tokens - cursor))
    mask = np.frombuffer(bytearray().join(parts), dtype=bool)
    for slot, piece in scattered:
        mask[slot : slot + len(piece)] |= np.frombuffer(piece, dtype=bool)
    return mask


def _padded_positions(index: RequestFeatureIndex, end: int) -> bytes:
    """The index's embed positions, extended with zero bytes to at least
    ``end`` (kept, doubling, so that later windows slice without padding)."""
    positions = index.embed_positions
    index.embed_positions = positions + bytes(max(end, 2 * len(positions)) - len(positions))
    return index.embed_positions


def _check_output(
    out: torch.Tensor | None,
    entry: FeatureEntry,
    req_id: str,
    qs: int,
    qe: int,
    rs: int,
    re_: int,
    draft_lookahead: int,
) -> None:
    """Return for the drafter's boundary item that is not encoded yet (it is
    skipped); raise for any other miss and for a wrong row count."""
    if out is None:
        if entry.offset + draft_lookahead >= qe:  # the drafter's boundary item
            return
        raise RuntimeError(
            f"Encoder cache miss for {entry.identifier}: request {req_id} needs "
            f"rows [{rs}, {re_}) of its {entry.modality} item at placeholder "
            f"offset {entry.offset} for prompt window [{qs}, {qe})"
        )
    raise RuntimeError(
        f"Encoder output for {entry.identifier} has {out.shape[0]} rows, expected "
        f"{entry.num_embeds} (get_num_embeds() of the {entry.modality} item of "
        f"request {req_id} at offset {entry.offset}); refusing to gather a "
        "stale or colliding cache entry"
    )


def _unmark(entries: list[FeatureEntry], skipped: list[FeatureEntry], qs: int, piece: bytes) -> bytes:
    """A window's mask bytes without the drafter boundary items that were not
    gathered (each starts within ``draft_lookahead`` of the window's end, so
    they are its last items), re-marking the gathered items sharing those slots."""
    mask = np.frombuffer(piece, dtype=bool).copy()
    qe = qs + len(mask)
    first = min(entry.offset for entry in skipped)
    mask[max(first - qs, 0) :] = False
    for entry in entries:
        s, e = max(first, entry.offset, qs), min(qe, entry.end)
        if any(entry is other for other in skipped) or s >= e:
            continue
        if entry.is_embed is None:
            mask[s - qs : e - qs] = True
        else:
            mask[s - qs : e - qs] |= entry.is_embed[s - entry.offset : e - entry.offset]
    return mask.tobytes()

