"""Runs the multimodal encoder, gathers cached encoder rows for a step, and
merges them into the token embeddings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from omnistage.worker.mm.encoder_cache import EncoderCache
from omnistage.worker.mm.window_gather import GatheredRows, gather_windows

__all__ = ["EncoderRunner", "MultiModalEmbedder"]


@runtime_checkable
class MultiModalEmbedder(Protocol):
    """What a model adapter provides to the encoder runner.

    ``embed_multimodal(modality, items)`` encodes a batch of items of one
    modality (each item is the ``data`` of a ``MultiModalFeatureSpec``) and
    returns one tensor ``[num_embeds, hidden]`` per item, in order, where
    ``num_embeds`` is the item's ``mm_position.get_num_embeds()``.

    ``embed_input_ids(input_ids)`` maps token ids ``[num_tokens]`` to token
    embeddings ``[num_tokens, hidden]``.

    An adapter whose items may sit anywhere in the sequence, not only inside
    the prompt (streaming / realtime input), sets ``supports_realtime = True``.
    """

    def embed_multimodal(self, modality: str, items: list[Any]) -> Sequence[torch.Tensor]: ...

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor: ...


def _as_array(name: str, values: Any, count: int) -> np.ndarray:
    """The first ``count`` entries of a per-request 1-D array (a view)."""
    array = np.asarray(values)
    if array.ndim != 1 or array.shape[0] < count:
        raise ValueError(
            f"gather_mm_embeddings: {name} must be a 1-D array with at least "
            f"{count} entries (one per request), got shape {array.shape}"
        )
    return array[:count]


class EncoderRunner:
    """Encodes scheduled items and assembles ``inputs_embeds`` for a step.

    ``inputs_embeds`` is a persistent ``[max_num_tokens, hidden_size]`` buffer,
    so that its address is stable across steps (CUDA graphs read it).
    """

    def __init__(
        self,
        model: MultiModalEmbedder | None,
        max_num_tokens: int,
        hidden_size: int,
        encoder_cache: EncoderCache,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if max_num_tokens <= 0 or hidden_size <= 0:
            raise ValueError(
                "EncoderRunner: expected max_num_tokens > 0 and hidden_size > 0, "
                f"got max_num_tokens={max_num_tokens}, hidden_size={hidden_size}"
            )
        self.model = model
        self.encoder_cache = encoder_cache
        self.max_num_tokens = max_num_tokens
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.is_realtime = getattr(model, "supports_realtime", False) is True
        self.inputs_embeds = torch.zeros(max_num_tokens, hidden_size, dtype=dtype, device=device)

    # ------------------------------------------------------------------ encode

    def prepare_mm_inputs(
        self, scheduled_encoder_inputs: dict[str, list[int]]
    ) -> tuple[list[str], list[tuple[str, Any]]]:
        """List the items to encode: ``(identifiers, [(modality, data), ...])``
        in request order, then input order. Items without data are skipped."""
        mm_hashes: list[str] = []
        mm_kwargs: list[tuple[str, Any]] = []
        for req_id, input_ids in scheduled_encoder_inputs.items():
            features = self.encoder_cache.mm_features.get(req_id)
            if features is None:
                raise RuntimeError(
                    f"prepare_mm_inputs: request {req_id} has encoder inputs scheduled "
                    "but no registered multimodal items (EncoderCache.add_request)"
                )
            for input_id in input_ids:
                if not 0 <= input_id < len(features):
                    raise ValueError(
                        f"prepare_mm_inputs: request {req_id}: encoder input index "
                        f"{input_id} out of range, expected 0 <= index < {len(features)}"
                    )
                feature = features[input_id]
                if feature.data is None:
                    continue
                mm_hashes.append(feature.identifier)
                mm_kwargs.append((feature.modality, feature.data))
        return mm_hashes, mm_kwargs

    @torch.inference_mode()
    def execute_mm_encoder(self, mm_kwargs: list[tuple[str, Any]]) -> list[torch.Tensor]:
        """Encode items, one model call per run of consecutive same-modality
        items; returns one tensor per item, in input order."""
        outputs: list[torch.Tensor] = []
        start = 0
        while start < len(mm_kwargs):
            modality = mm_kwargs[start][0]
            stop = start + 1
            while stop < len(mm_kwargs) and mm_kwargs[stop][0] == modality:
                stop += 1
            items = [data for _, data in mm_kwargs[start:stop]]
            outputs.extend(self._check_encoder_outputs(modality, items, self.model.embed_multimodal(modality, items)))
            start = stop
        return outputs

    def _check_encoder_outputs(self, modality: str, items: list[Any], result: Any) -> list[torch.Tensor]:
        if isinstance(result, torch.Tensor) and result.ndim == 3:
            result = list(result.unbind(0))
        if not isinstance(result, (list, tuple)):
            raise RuntimeError(
                f"embed_multimodal({modality!r}) must return a list of tensors "
                f"(one per item), got {type(result).__name__}"
            )
        if len(result) != len(items):
            raise RuntimeError(
                f"embed_multimodal({modality!r}) returned {len(result)} outputs "
                f"for {len(items)} items; expected one tensor per item"
            )
        for k, out in enumerate(result):
            if not isinstance(out, torch.Tensor) or out.ndim != 2 or out.shape[1] != self.hidden_size:
                got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise RuntimeError(
                    f"embed_multimodal({modality!r}) output {k}: expected a tensor "
                    f"[num_embeds, {self.hidden_size}], got {got}"
                )
        return list(result)

    # ------------------------------------------------------------------ gather

    def gather_mm_embeddings(
        self,
        req_ids: list[str],
        total_num_scheduled_tokens: int,
        num_scheduled_tokens: np.ndarray,
        query_start_loc: np.ndarray,
        prefill_lens: np.ndarray,
        num_computed_tokens: np.ndarray,
        draft_lookahead: int = 0,
    ) -> tuple[Sequence[torch.Tensor], torch.Tensor]:
        """Collect the cached encoder rows that the step's tokens consume.

        Request i covers prompt positions ``[nc, nc + num_scheduled_tokens[i])``
        with ``nc = num_computed_tokens[i] + draft_lookahead``, at batch slots
        starting at ``query_start_loc[i]``. A drafter passes
        ``draft_lookahead=1``: it reads one position ahead, so the item starting
        exactly at the processed end may enter its window; that item is used if
        cached and skipped (token embedding kept) if not. Any other miss raises.

        Returns ``(rows, is_mm_embed)``: a sequence of read-only views of the
        encoder outputs (a ``GatheredRows``, which makes them on first access),
        each with a ``.modality`` attribute, ordered by request then offset, and a CPU bool mask ``[total_num_scheduled_tokens]`` of the
        slots they fill. Raises RuntimeError on a miss inside the processed
        range and on a cached output whose row count differs from the item's.
        """
        if draft_lookahead < 0:
            raise ValueError(f"gather_mm_embeddings: expected draft_lookahead >= 0, got {draft_lookahead}")
        num_tokens = int(total_num_scheduled_tokens)
        num_reqs = len(req_ids)
        mm_embeds: list[torch.Tensor] = []
        if num_reqs == 0:
            return mm_embeds, torch.zeros(num_tokens, dtype=torch.bool)

        computed_np = _as_array("num_computed_tokens", num_computed_tokens, num_reqs)
        if draft_lookahead:
            computed_np = computed_np + draft_lookahead  # never mutate the caller's array
        if self.is_realtime:
            active = np.arange(num_reqs)
        else:
            active = np.flatnonzero(computed_np < _as_array("prefill_lens", prefill_lens, num_reqs))
            if not active.size:  # every request is decoding: no prompt items in reach
                return mm_embeds, torch.zeros(num_tokens, dtype=torch.bool)
        scheduled_np = _as_array("num_scheduled_tokens", num_scheduled_tokens, num_reqs)
        starts_np = _as_array("query_start_loc", query_start_loc, num_reqs)
        slots, counts = starts_np[active], scheduled_np[active]
        outside = (slots < 0) | (counts < 0) | (slots + counts > num_tokens)
        if outside.any():
            k = int(np.argmax(outside))
            raise ValueError(
                f"gather_mm_embeddings: request {req_ids[active[k]]} has batch slots "
                f"[{slots[k]}, {slots[k] + counts[k]}), expected within [0, {num_tokens})"
            )
        rows, mask = gather_windows(
            self.encoder_cache,
            list(req_ids) if active.size == num_reqs else [req_ids[n] for n in active.tolist()],
            computed_np[active].tolist(),
            counts.tolist(),
            slots.tolist(),
            num_tokens,
            draft_lookahead,
        )
        return rows, torch.from_numpy(mask)

    # ------------------------------------------------------------------ merge

    @torch.inference_mode()
    def get_inputs_embeds(
        self,
        input_ids: torch.Tensor,
        mm_embeds: Sequence[torch.Tensor],
        is_mm_embed: torch.Tensor,
    ) -> torch.Tensor:
        """Token embeddings with the gathered rows written over the masked
        positions, in order. Written into the persistent buffer; returns the
        view ``inputs_embeds[:num_tokens]``."""
        num_tokens = input_ids.shape[0]
        if input_ids.ndim != 1 or num_tokens > self.max_num_tokens:
            raise ValueError(
                f"get_inputs_embeds: expected 1-D input_ids of at most "
                f"{self.max_num_tokens} tokens, got shape {tuple(input_ids.shape)}"
            )
        if is_mm_embed.dtype != torch.bool or tuple(is_mm_embed.shape) != (num_tokens,):
            raise ValueError(
                f"get_inputs_embeds: expected is_mm_embed of dtype torch.bool and "
                f"shape ({num_tokens},), got {is_mm_embed.dtype} {tuple(is_mm_embed.shape)}"
            )
        token_embeds = self.model.embed_input_ids(input_ids)
        if tuple(token_embeds.shape) != (num_tokens, self.hidden_size):
            raise RuntimeError(
                f"embed_input_ids returned shape {tuple(token_embeds.shape)}, "
                f"expected ({num_tokens}, {self.hidden_size})"
            )
        buffer = self.inputs_embeds[:num_tokens]
        buffer.copy_(token_embeds)
        positions = torch.nonzero(is_mm_embed.cpu()).squeeze(1)
        if isinstance(mm_embeds, GatheredRows):  # the gather's spans: no per-item views
            num_rows = mm_embeds.num_rows
            mm_embeds = mm_embeds.tensors() if num_rows else []
        else:
            num_rows = sum(t.shape[0] for t in mm_embeds)
        if num_rows != positions.numel():
            raise RuntimeError(
                f"get_inputs_embeds: is_mm_embed marks {positions.numel()} positions "
                f"but mm_embeds hold {num_rows} rows"
            )
        if num_rows:
            rows = mm_embeds[0] if len(mm_embeds) == 1 else torch.cat(mm_embeds)
            buffer.index_copy_(
                0,
                positions.to(self.device, non_blocking=True),
                rows.to(device=self.device, dtype=self.dtype),
            )
        return buffer
