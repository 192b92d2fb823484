"""Qwen2.5-Omni thinker adapter: image, video and audio towers, M-RoPE."""

from __future__ import annotations

from typing import Any

import torch

from omnistage.models.mm_adapter import QwenMultiModalAdapter
from omnistage.multimodal.inputs import MultiModalFeatureSpec
from omnistage.multimodal.processing import audio_output_length

__all__ = ["Qwen2_5OmniThinkerAdapter", "padded_audio_batch"]


def padded_audio_batch(items: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Audio items' ``input_features`` ``[num_mel_bins, frames]`` as one right-padded
    batch for the audio tower: ``(features, feature_attention_mask, frames per item)``."""
    lengths = [int(item["input_features"].shape[1]) for item in items]
    num_bins = items[0]["input_features"].shape[0]
    features = torch.zeros(len(items), num_bins, max(lengths), dtype=torch.float32)
    mask = torch.zeros(len(items), max(lengths), dtype=torch.int64)
    for k, (item, n) in enumerate(zip(items, lengths)):
        features[k, :, :n] = item["input_features"]
        mask[k, :n] = 1
    return features, mask, lengths


class Qwen2_5OmniThinkerAdapter(QwenMultiModalAdapter):
    """Wraps ``Qwen2_5OmniThinkerForConditionalGeneration`` (or the full
    ``Qwen2_5OmniForConditionalGeneration``, whose ``thinker`` it uses).

    Audio items carry ``input_features`` ``[num_mel_bins, frames]`` (the valid
    frames only) and ``audio_feature_lengths`` ``[1]``; image and video items
    are as for Qwen2.5-VL (videos: ``second_per_grid_ts``).
    """

    modalities = ("image", "video", "audio")

    def __init__(self, model: Any) -> None:
        super().__init__(getattr(model, "thinker", model))

    def _encode_audio(self, items: list[dict[str, Any]]) -> list[torch.Tensor]:
        features, mask, lengths = padded_audio_batch(items)
        out = self.inner.get_audio_features(
            features.to(self.device, self.inner.audio_tower.conv1.weight.dtype),
            feature_attention_mask=mask.to(self.device),
            return_dict=True,
        )
        return list(out.last_hidden_state.split([audio_output_length(n) for n in lengths]))

    def _rope_index(self, input_ids: torch.Tensor, features: list[MultiModalFeatureSpec]) -> tuple[torch.Tensor, Any]:
        return self.inner.get_rope_index(
            input_ids,
            image_grid_thw=self._gather(features, "image", "image_grid_thw"),
            video_grid_thw=self._gather(features, "video", "video_grid_thw"),
            attention_mask=torch.ones_like(input_ids),
            use_audio_in_video=False,
            audio_seqlens=self._gather(features, "audio", "audio_feature_lengths"),
            second_per_grids=self._gather(features, "video", "second_per_grid_ts"),
        )
