"""Qwen2.5-VL adapter: image and video towers, M-RoPE positions."""

from __future__ import annotations

from typing import Any

import torch

from omnistage.models.mm_adapter import QwenMultiModalAdapter
from omnistage.multimodal.inputs import MultiModalFeatureSpec

__all__ = ["Qwen2_5_VLAdapter"]


class Qwen2_5_VLAdapter(QwenMultiModalAdapter):
    """Wraps ``Qwen2_5_VLForConditionalGeneration``.

    Item data (from ``MultiModalProcessor``): images carry ``pixel_values``
    ``[patches, 3*2*14*14]`` and ``image_grid_thw`` ``[1, 3]``; videos carry
    ``pixel_values_videos``, ``video_grid_thw`` and ``second_per_grid_ts``
    ``[1]`` (seconds per temporal patch, which spaces the temporal positions).
    """

    modalities = ("image", "video")

    def _rope_index(self, input_ids: torch.Tensor, features: list[MultiModalFeatureSpec]) -> tuple[torch.Tensor, Any]:
        config = self.config
        token_type = torch.zeros_like(input_ids, dtype=torch.int32)
        token_type[input_ids == config.image_token_id] = 1
        token_type[input_ids == config.video_token_id] = 2
        image_grid = self._gather(features, "image", "image_grid_thw")
        video_grid = self._gather(features, "video", "video_grid_thw")
        second_per_grid = self._gather(features, "video", "second_per_grid_ts")
        return self.inner.get_rope_index(
            input_ids,
            mm_token_type_ids=token_type,
            image_grid_thw=image_grid,
            video_grid_thw=video_grid,
            second_per_grid_ts=second_per_grid,
            attention_mask=torch.ones_like(input_ids),
        )
