"""Per-model worker state: the encoder cache and runner a step's inputs need."""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from omnistage.worker.mm.encoder_cache import EncoderCache
from omnistage.worker.mm.encoder_runner import EncoderRunner, MultiModalEmbedder

__all__ = ["ModelState", "StepInputs"]


class StepInputs(Protocol):
    """The fields of the per-step batch description (``BatchStep``) used here."""

    req_ids: list[str]
    num_scheduled_tokens: np.ndarray  # [R]
    query_start_loc: np.ndarray  # [R + 1]
    num_computed_tokens: np.ndarray  # [R], before this step
    prefill_lens: np.ndarray  # [R]
    num_tokens: int  # total scheduled tokens
    input_ids: torch.Tensor  # [>= num_tokens]


class ModelState:
    """Owns what turns a step's token ids and multimodal items into
    ``inputs_embeds``. A text-only model has no encoder cache and no runner."""

    def __init__(
        self,
        model: MultiModalEmbedder,
        encoder_cache: EncoderCache | None,
        max_num_tokens: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model = model
        self.encoder_cache = encoder_cache
        self.supports_mm_inputs = encoder_cache is not None
        self.encoder_runner: EncoderRunner | None = None
        if encoder_cache is not None:
            self.encoder_runner = EncoderRunner(
                model, max_num_tokens, hidden_size, encoder_cache, dtype, device
            )

    def execute_mm_encoder(self, scheduled_encoder_inputs: dict[str, list[int]]) -> None:
        """Encode the scheduled items and publish them in the encoder cache.

        This is all an encoder-only (EPD producer) instance does: it never
        gathers, since it runs no language model and items the connector
        already holds are absent from its cache by design.
        """
        if self.encoder_runner is None:
            if any(scheduled_encoder_inputs.values()):
                raise ValueError(
                    "execute_mm_encoder: encoder inputs were scheduled "
                    f"({scheduled_encoder_inputs}) for a model without an encoder cache"
                )
            return
        mm_hashes, mm_kwargs = self.encoder_runner.prepare_mm_inputs(scheduled_encoder_inputs)
        if not mm_kwargs:
            return
        outputs = self.encoder_runner.execute_mm_encoder(mm_kwargs)
        if len(outputs) != len(mm_hashes):
            raise RuntimeError(
                f"execute_mm_encoder: {len(outputs)} encoder outputs for "
                f"{len(mm_hashes)} scheduled items"
            )
        self.encoder_cache.encoder_outputs.update(zip(mm_hashes, outputs))

    def gather_mm_embeddings(
        self, step: StepInputs, draft_lookahead: int = 0
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The step's cached encoder rows and their slot mask (see
        ``EncoderRunner.gather_mm_embeddings``); nothing for a text-only model."""
        if self.encoder_runner is None:
            return [], torch.zeros(step.num_tokens, dtype=torch.bool)
        return self.encoder_runner.gather_mm_embeddings(
            step.req_ids,
            step.num_tokens,
            step.num_scheduled_tokens,
            step.query_start_loc,
            step.prefill_lens,
            step.num_computed_tokens,
            draft_lookahead,
        )

    def prepare_inputs_embeds(
        self, scheduled_encoder_inputs: dict[str, list[int]], step: StepInputs
    ) -> torch.Tensor:
        """Encode, gather, merge: ``inputs_embeds`` ``[num_tokens, hidden]``.

        For a multimodal model the result is a view of the runner's persistent
        buffer, valid until the next step."""
        input_ids = step.input_ids[: step.num_tokens]
        if self.encoder_runner is None:
            self.execute_mm_encoder(scheduled_encoder_inputs)  # rejects stray items
            return self.model.embed_input_ids(input_ids)
        self.execute_mm_encoder(scheduled_encoder_inputs)
        mm_embeds, is_mm_embed = self.gather_mm_embeddings(step)
        return self.encoder_runner.get_inputs_embeds(input_ids, mm_embeds, is_mm_embed)

    def dummy_inputs_embeds(self, num_tokens: int) -> torch.Tensor | None:
        """The persistent buffer's first rows, for dummy / graph-capture runs."""
        if self.encoder_runner is None:
            return None
        return self.encoder_runner.inputs_embeds[:num_tokens]
