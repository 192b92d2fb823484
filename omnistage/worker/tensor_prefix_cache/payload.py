"""Dividing one step's packed outputs among the requests of the batch.

A step's outputs are packed: request ``i`` owns rows ``[start_i, start_i + n_i)``
of every token-aligned tensor. ``RequestSpans`` records that layout once per
step; ``divide_among_requests`` applies the passthrough rules that decide what
each request receives from an output the tensor prefix cache does not store:

- a tensor whose first dim is the step's scheduled-token count is token aligned:
  each request gets its own rows (a view, no copy);
- any other tensor (0-d included) is request invariant: each request gets a
  clone of the whole tensor, so one request's mutation never reaches another's;
- a list is handed whole to every request (tensors inside cloned): per-request
  indexing of lists happens later, after postprocessing;
- a dict is divided key by key with these same rules;
- anything else (str, int, ...) is shared as is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import accumulate
from operator import add
from typing import Any, NamedTuple

import torch


class RequestSpans(NamedTuple):
    """Where each request's rows lie in a step's packed outputs."""

    req_ids: list[str]
    starts: list[int]
    lengths: list[int]
    end: int  # one past the last row any request owns: how many rows a source must have
    total: int  # scheduled tokens of the step: the first dim of a token-aligned tensor
    packed: bool  # spans tile [starts[0], end) in batch order, so one split serves them all

    @classmethod
    def from_step(cls, query_start_loc: Any, input_batch: Any, num_scheduled_tokens: Mapping[str, int]) -> RequestSpans:
        """Spans of ``input_batch.req_ids``; ``query_start_loc`` is indexed by batch row."""
        req_ids = input_batch.req_ids
        qsl = int_list(query_start_loc)
        try:  # map() over bound lookups: no Python-level loop per request
            starts = list(map(qsl.__getitem__, map(input_batch.req_id_to_index.__getitem__, req_ids)))
        except (IndexError, KeyError):
            raise ValueError(
                f"query_start_loc has {len(qsl)} entries for {len(req_ids)} requests; "
                "expected one per batch row of every request in req_id_to_index"
            ) from None
        try:
            lengths = list(map(num_scheduled_tokens.__getitem__, req_ids))
        except KeyError as missing:
            raise ValueError(
                f"num_scheduled_tokens has no entry for request {missing}; expected one per request in the batch"
            ) from None
        return cls.build(req_ids, starts, lengths)

    @classmethod
    def build(cls, req_ids: list[str], starts: list[int], lengths: list[int]) -> RequestSpans:
        # Builtins over lists, not a Python loop: this runs every step for every request.
        if not req_ids:
            return cls([], [], [], 0, 0, True)
        if min(starts) < 0 or min(lengths) < 0:
            i = next(i for i, (s, n) in enumerate(zip(starts, lengths)) if s < 0 or n < 0)
            raise ValueError(
                f"request {req_ids[i]!r}: expected a non-negative start and token count, "
                f"got start={starts[i]}, num_scheduled_tokens={lengths[i]}"
            )
        packed = starts == list(accumulate(lengths[:-1], initial=starts[0]))
        end = starts[-1] + lengths[-1] if packed else max(map(add, starts, lengths))
        return cls(req_ids, starts, lengths, end, sum(lengths), packed)

    def split(self, rows: torch.Tensor) -> Sequence[torch.Tensor]:
        """Each request's rows of ``rows`` (which has at least ``end`` rows), as views."""
        if self.packed:
            # One split_with_sizes call: a narrow() per request costs several times more.
            base = self.starts[0] if self.starts else 0
            if base or rows.shape[0] != self.end:
                rows = rows.narrow(0, base, self.end - base)
            return torch.split_with_sizes(rows, self.lengths)
        return [rows.narrow(0, s, n) for s, n in zip(self.starts, self.lengths)]


def to_cpu_tree(value: Any) -> Any:
    """Tensors moved to contiguous CPU tensors (no copy if already there).

    Dict and list nesting is kept; ``None`` values and dicts left empty are
    dropped, as on the output path that does not use the prefix cache.
    """
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu").contiguous()
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if item is None:
                continue
            item = to_cpu_tree(item)
            if isinstance(item, dict) and not item:
                continue
            out[key] = item
        return out
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu_tree(item) for item in value)
    return value


def divide_among_requests(value: Any, spans: RequestSpans) -> list[Any]:
    """What each request (in ``spans`` order) receives of a passthrough output."""
    count = len(spans.req_ids)
    if isinstance(value, torch.Tensor):
        if value.ndim > 0 and value.shape[0] == spans.total:
            if spans.end > value.shape[0]:
                raise ValueError(
                    f"token-aligned output of {value.shape[0]} rows cannot cover request spans "
                    f"reaching row {spans.end}"
                )
            return list(spans.split(value))
        return [value.clone() for _ in range(count)]
    if isinstance(value, dict):
        per_key = {key: divide_among_requests(item, spans) for key, item in value.items()}
        return [{key: parts[i] for key, parts in per_key.items()} for i in range(count)]
    if isinstance(value, list):
        return [_clone_tensors(value) for _ in range(count)]
    return [value] * count


def _clone_tensors(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_clone_tensors(item) for item in value)
    if isinstance(value, dict):
        return {key: _clone_tensors(item) for key, item in value.items()}
    return value


def int_list(values: Any) -> list[int]:
    """Python ints of a list, numpy array or tensor (on any device)."""
    if isinstance(values, torch.Tensor):
        return (values.long() if values.is_floating_point() else values).tolist()
    if hasattr(values, "tolist"):
        return values.tolist()
    return list(values)
