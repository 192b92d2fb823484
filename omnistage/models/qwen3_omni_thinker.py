"""Qwen3-Omni thinker adapter: the MoE text stack, the audio tower, M-RoPE, and the talker's per-token rows.

The text stack is transformers' ``Qwen3OmniMoeThinkerTextModel`` on paged
attention (``CausalLM`` over ``TextStackView``). Its sparse MoE blocks are
transformers' own: the router picks the top-k experts per token and each hit
expert runs once on all of its tokens (batched per expert, never per token);
the thinker has no shared expert (the talker has one).

What the talker reads for every token the thinker forwarded is one row of
the thinker's width (``per_token_outputs``):

- at audio / image / video placeholders: the output of layer
  ``accept_hidden_layer`` (transformers' ``hidden_states[accept_hidden_layer]``;
  the final normed state when that index is the last), which the talker
  projects with ``hidden_projection``;
- everywhere else: the input embedding (``hidden_states[0]``), which it
  projects with ``text_projection``.

transformers' ``generate`` never reads the other tensor at a position, so
one row per token is the whole hand-off. The layer output is captured by a
forward hook during the step's own forward, so it costs no extra compute.
"""

from __future__ import annotations

from typing import Any

import torch

from omnistage.models.interface import TensorCachePolicy
from omnistage.models.mm_adapter import QwenMultiModalAdapter
from omnistage.multimodal.inputs import MultiModalFeatureSpec
from omnistage.multimodal.processing import qwen3_audio_output_length

__all__ = ["QWEN3_THINKER_FOR_TALKER_POLICY", "Qwen3OmniThinkerAdapter"]

# The talker reads one row per token for every token the thinker forwarded, prefix included.
QWEN3_THINKER_FOR_TALKER_POLICY = TensorCachePolicy(full_prefix_hidden=True)


class Qwen3OmniThinkerAdapter(QwenMultiModalAdapter):
    """Wraps ``Qwen3OmniMoeThinkerForConditionalGeneration`` (or the whole model, whose ``thinker`` it uses).

    Audio items carry ``input_features`` ``[num_mel_bins, frames]`` (valid frames
    only) and ``audio_feature_lengths`` ``[1]``. Images and video are not wired
    yet: their deepstack features enter the first decoder layers, which the
    encoder cache's one-row-per-placeholder merge does not carry.
    """

    modalities = ("audio",)
    tensor_cache_policy = QWEN3_THINKER_FOR_TALKER_POLICY

    def __init__(self, model: Any, accept_hidden_layer: int | None = None) -> None:
        super().__init__(getattr(model, "thinker", model))
        ids = [
            int(getattr(self.config, n))
            for n in ("audio_token_id", "image_token_id", "video_token_id")
        ]
        self._placeholders = torch.tensor(ids, device=self.device)
        layers = self.language_model.layers
        self.accept_hidden_layer = (
            len(layers) if accept_hidden_layer is None else int(accept_hidden_layer)
        )
        if not 1 <= self.accept_hidden_layer <= len(layers):
            raise ValueError(
                f"accept_hidden_layer={self.accept_hidden_layer}: expected 1..{len(layers)} (the thinker's layers)"
            )
        self._accepted: torch.Tensor | None = None
        if self.accept_hidden_layer < len(layers):
            # hidden_states[k] is layer k-1's output; the last index is the final normed state instead.
            layers[self.accept_hidden_layer - 1].register_forward_hook(self._capture)

    def _capture(self, module: Any, args: Any, output: Any) -> None:
        self._accepted = output[0] if isinstance(output, tuple) else output

    # ------------------------------------------------------------- towers

    def _encode_audio(self, items: list[dict[str, Any]]) -> list[torch.Tensor]:
        lengths = [int(item["input_features"].shape[1]) for item in items]
        num_bins = items[0]["input_features"].shape[0]
        features = torch.zeros(len(items), num_bins, max(lengths), dtype=torch.float32)
        mask = torch.zeros(len(items), max(lengths), dtype=torch.int64)
        for k, (item, n) in enumerate(zip(items, lengths)):
            features[k, :, :n] = item["input_features"]
            mask[k, :n] = 1
        out = self.inner.get_audio_features(
            features.to(self.device, self.inner.audio_tower.conv2d1.weight.dtype),
            feature_attention_mask=mask.to(self.device),
            return_dict=True,
        )
        n_window = int(self.inner.audio_tower.n_window)
        return list(
            out.last_hidden_state.split(
                [qwen3_audio_output_length(int(n), n_window) for n in lengths]
            )
        )

    def _rope_index(
        self, input_ids: torch.Tensor, features: list[MultiModalFeatureSpec]
    ) -> tuple[torch.Tensor, Any]:
        return self.inner.get_rope_index(
            input_ids,
            image_grid_thw=self._gather(features, "image", "image_grid_thw"),
            video_grid_thw=self._gather(features, "video", "video_grid_thw"),
            attention_mask=torch.ones_like(input_ids),
            use_audio_in_video=False,
            audio_seqlens=self._gather(features, "audio", "audio_feature_lengths"),
            second_per_grids=self._gather(features, "video", "second_per_grid_ts"),
        )

    # ----------------------------------------------------- talker hand-off

    @torch.inference_mode()
    def per_token_outputs(
        self, hidden: torch.Tensor, input_ids: torch.Tensor
    ) -> torch.Tensor:
        """``[T, hidden]`` rows the talker reads, for the step's packed tokens (see the module docstring)."""
        n = input_ids.shape[0]
        is_mm = torch.isin(input_ids, self._placeholders)
        if not bool(is_mm.any()):
            return self.embed_input_ids(input_ids)
        accepted = (
            hidden
            if self._accepted is None
            else self._accepted.reshape(-1, hidden.shape[-1])[:n]
        )
        return torch.where(
            is_mm[:, None], accepted.to(hidden.dtype), self.embed_input_ids(input_ids)
        )
