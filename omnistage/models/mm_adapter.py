"""What the engine needs of a Hugging Face multimodal model, in one place.

An adapter wraps a loaded transformers model and offers:

- ``embed_input_ids(ids [T]) -> [T, hidden]``: token embeddings;
- ``embed_multimodal(modality, items) -> list[[num_embeds, hidden]]``: the
  towers run on a batch of items (each the ``data`` of a
  ``MultiModalFeatureSpec``), split back into one tensor per item;
- ``get_mrope_positions(prompt_token_ids, mm_features) -> MRopePositions``:
  the 3 x L multimodal rotary positions of a prompt, computed once per request
  with transformers' own ``get_rope_index``, plus the decode-time delta;
- ``language_model`` / ``compute_logits``: the text stack, to run packed on
  ``inputs_embeds`` with those positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from omnistage.multimodal.inputs import MultiModalFeatureSpec

__all__ = ["MRopePositions", "QwenMultiModalAdapter"]


@dataclass
class MRopePositions:
    """M-RoPE positions of one request.

    ``prompt`` is ``[3, num_prompt_tokens]`` (temporal, height, width). A
    token at index ``p >= num_prompt_tokens`` (generated) has position
    ``p + delta`` on all three axes, ``delta`` being ``max(prompt) + 1 -
    num_prompt_tokens`` (negative when vision grids compress positions).
    """

    prompt: torch.Tensor
    delta: int

    @property
    def num_prompt_tokens(self) -> int:
        return self.prompt.shape[1]

    def get(self, start: int, end: int) -> torch.Tensor:
        """Positions ``[3, end - start]`` of the tokens at indices ``[start, end)``."""
        if not 0 <= start <= end:
            raise ValueError(f"MRopePositions.get: expected 0 <= start <= end, got ({start}, {end})")
        n = self.num_prompt_tokens
        if end <= n:
            return self.prompt[:, start:end]
        tail_start = max(start, n)
        tail = torch.arange(tail_start + self.delta, end + self.delta, dtype=self.prompt.dtype)
        tail = tail.unsqueeze(0).expand(3, -1)
        if start >= n:
            return tail
        return torch.cat([self.prompt[:, start:], tail], dim=1)


class QwenMultiModalAdapter:
    """Shared part of the Qwen2.5-VL and Qwen2.5-Omni thinker adapters.

    ``model`` is the ``...ForConditionalGeneration`` module; its inner
    ``model`` holds ``visual``, ``language_model`` (and ``audio_tower``).
    """

    modalities: tuple[str, ...] = ()

    def __init__(self, model: Any) -> None:
        self.model = model
        self.inner = model.model
        self.language_model = self.inner.language_model
        self.lm_head = model.lm_head
        self.config = model.config
        self.hidden_size = self.config.get_text_config().hidden_size

    @property
    def device(self) -> torch.device:
        # The vision tower's, not the LM head's: an encoder-only worker's LM
        # head sits on the meta device (``mm_loader.load_mm_encoder``).
        return next(self.inner.visual.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    # ---------------------------------------------------------- embeddings

    @torch.inference_mode()
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_tokens(input_ids.to(self.device))

    @torch.inference_mode()
    def embed_multimodal(self, modality: str, items: list[dict[str, Any]]) -> list[torch.Tensor]:
        if modality not in self.modalities:
            raise ValueError(
                f"embed_multimodal: modality {modality!r} is not supported; expected one of {self.modalities}"
            )
        if not items:
            return []
        outputs = getattr(self, f"_encode_{modality}")(items)
        return [out.to(self.dtype) for out in outputs]

    def _cat(self, items: list[dict[str, Any]], key: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.cat([item[key] for item in items]).to(device=self.device, dtype=dtype)

    def _encode_image(self, items: list[dict[str, Any]]) -> list[torch.Tensor]:
        out = self.inner.get_image_features(
            self._cat(items, "pixel_values"), self._cat(items, "image_grid_thw", torch.int64), return_dict=True
        )
        return list(out.pooler_output)

    def _encode_video(self, items: list[dict[str, Any]]) -> list[torch.Tensor]:
        out = self.inner.get_video_features(
            self._cat(items, "pixel_values_videos"), self._cat(items, "video_grid_thw", torch.int64), return_dict=True
        )
        return list(out.pooler_output)

    # ----------------------------------------------------------- positions

    @staticmethod
    def _gather(features: Sequence[MultiModalFeatureSpec], modality: str, key: str) -> torch.Tensor | None:
        values = [f.data[key] for f in features if f.modality == modality]
        return torch.cat(values) if values else None

    def get_mrope_positions(
        self, prompt_token_ids: Sequence[int] | torch.Tensor, mm_features: Sequence[MultiModalFeatureSpec]
    ) -> MRopePositions:
        input_ids = torch.as_tensor(list(prompt_token_ids) if not isinstance(prompt_token_ids, torch.Tensor)
                                    else prompt_token_ids, dtype=torch.int64).reshape(1, -1)
        features = sorted(mm_features, key=lambda f: f.mm_position.offset)
        missing = [k for k, f in enumerate(features) if f.data is None]
        if missing:
            raise ValueError(
                f"get_mrope_positions: mm_features {missing} have no data; the grid sizes are needed"
            )
        with torch.inference_mode():
            positions, delta = self._rope_index(input_ids, features)
        return MRopePositions(positions[:, 0].to(torch.int64).contiguous(), int(delta.reshape(-1)[0]))

    def _rope_index(self, input_ids: torch.Tensor, features: list[MultiModalFeatureSpec]) -> tuple[torch.Tensor, Any]:
        raise NotImplementedError

    # -------------------------------------------------------------- forward

    @torch.inference_mode()
    def forward(
        self, inputs_embeds: torch.Tensor, positions: torch.Tensor, seq_lens: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Reference forward: ``inputs_embeds [T, hidden]`` at M-RoPE
        ``positions [3, T]`` -> hidden states ``[T, hidden]``, dense causal
        attention. With ``seq_lens`` the T tokens are several whole sequences
        packed back to back, each attending only to itself (transformers
        detects the packing from the restarting text positions). The engine
        runs the same layers with paged attention."""
        position_ids = positions.unsqueeze(1)
        if seq_lens is not None:
            if sum(seq_lens) != inputs_embeds.shape[0]:
                raise ValueError(f"forward: seq_lens sum to {sum(seq_lens)}, expected {inputs_embeds.shape[0]} tokens")
            text = torch.cat([torch.arange(n, dtype=positions.dtype) for n in seq_lens])
            position_ids = torch.cat([text.view(1, 1, -1), position_ids])
        out = self.language_model(
            inputs_embeds=inputs_embeds.unsqueeze(0).to(self.device),
            position_ids=position_ids.to(self.device),
            use_cache=False,
        )
        return out.last_hidden_state[0]

    @torch.inference_mode()
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)
