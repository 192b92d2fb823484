"""Qwen2-VL-family video preprocessing without torchvision.

transformers' ``Qwen2VLVideoProcessor`` (used by Qwen2-VL, Qwen2.5-VL and
Qwen2.5-Omni) needs torchvision, which has no build beside our CPU torch.
This module reproduces its arithmetic on CPU with torch alone, step for step:

1. frames ``uint8 [T, H, W, C]`` -> ``[T, C, H, W]``;
2. resize to ``smart_resize(H, W, patch * merge, shortest_edge, longest_edge)``
   unless the size is unchanged: torchvision's CPU kernel for bicubic (and, on
   AVX2 machines, bilinear) resizes uint8 tensors natively, which is
   ``F.interpolate(uint8, mode, align_corners=False, antialias=True)``;
3. fused rescale + normalize in float32: ``(x - mean / s) / (std / s)`` with
   the mean and std tensors scaled by ``1 / rescale_factor`` in float32;
4. pad the frame count to a multiple of ``temporal_patch_size`` by repeating
   the last frame, and flatten into ``[t * h * w, C * tps * p * p]`` patches
   in the merge-window order the vision tower expects.

Frames are used as given (``do_sample_frames`` is not applied): sample them
before passing the video. ``cap_pixels_per_frame`` is honoured.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from omnistage.multimodal.processor_config import processor_settings

__all__ = ["QwenVideoPreprocessor", "smart_resize"]

_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
_MODES = {0: "nearest", 2: "bilinear", 3: "bicubic"}  # PIL resampling enum -> interpolate mode


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The Qwen2-VL resize rule: both sides multiples of ``factor``, area in
    ``[min_pixels, max_pixels]``, aspect ratio kept as closely as possible."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass
class QwenVideoPreprocessor:
    """Settings of a checkpoint's video processor and the preprocessing."""

    size: dict[str, int] = field(
        default_factory=lambda: {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768}
    )
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: list[float] = field(default_factory=lambda: list(_CLIP_MEAN))
    image_std: list[float] = field(default_factory=lambda: list(_CLIP_STD))
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    resample: int = 3  # PIL BICUBIC
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 128000

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> QwenVideoPreprocessor:
        """Apply a processor config as transformers does (``min_pixels`` /
        ``max_pixels`` override the size's edges); unknown keys are ignored."""
        config = dict(config)
        size = dict(config.pop("size", None) or cls().size)
        if config.get("min_pixels") is not None:
            size["shortest_edge"] = config["min_pixels"]
        if config.get("max_pixels") is not None:
            size["longest_edge"] = config["max_pixels"]
        known = {f for f in cls.__dataclass_fields__ if f != "size"}
        kwargs = {k: v for k, v in config.items() if k in known and v is not None}
        return cls(size=size, **kwargs)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> QwenVideoPreprocessor:
        """The checkpoint's video processor settings, read from whichever
        layout holds them in transformers' order of precedence (see
        ``processor_config.py``); class defaults when there are none."""
        settings = processor_settings(path, "video")
        return cls() if settings is None else cls.from_dict(settings.values)

    def with_options(self, options: dict[str, Any] | None) -> QwenVideoPreprocessor:
        """A copy with per-request overrides (``size``, ``min_pixels`` ...)."""
        if not options:
            return self
        merged = {**self.__dict__, **options}
        if "size" in options or "min_pixels" in options or "max_pixels" in options:
            merged["size"] = {**self.size, **(options.get("size") or {})}
        return type(self).from_dict(merged)

    def resized_hw(self, height: int, width: int, num_frames: int) -> tuple[int, int]:
        if not self.do_resize:
            return height, width
        factor = self.patch_size * self.merge_size
        max_pixels = self.size["longest_edge"]
        if self.cap_pixels_per_frame:
            total = int(self.max_video_tokens * factor * factor * 0.9)
            max_pixels = max(
                min(max_pixels, total * self.temporal_patch_size // num_frames),
                int(self.size["shortest_edge"] * 1.05),
            )
        return smart_resize(height, width, factor, self.size["shortest_edge"], max_pixels)

    def grid_thw(self, num_frames: int, height: int, width: int) -> tuple[int, int, int]:
        """Patch grid of a video of this size, without processing it."""
        h, w = self.resized_hw(height, width, num_frames)
        t = -(-num_frames // self.temporal_patch_size)
        return t, h // self.patch_size, w // self.patch_size

    def __call__(self, frames: np.ndarray) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """``uint8 [T, H, W, C]`` frames -> ``(pixel_values_videos [t*h*w, C*tps*p*p]
        float32, (t, h, w))``."""
        video = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).contiguous()
        num_frames, channels, height, width = video.shape
        new_h, new_w = self.resized_hw(height, width, num_frames)
        if (new_h, new_w) != (height, width):
            mode = _MODES.get(int(self.resample))
            if mode is None:
                raise ValueError(
                    f"video resample mode {self.resample} is not supported without torchvision; "
                    "expected 0 (nearest), 2 (bilinear) or 3 (bicubic)"
                )
            antialias = mode != "nearest"
            align = None if mode == "nearest" else False
            video = torch.nn.functional.interpolate(
                video, size=[new_h, new_w], mode=mode, align_corners=align, antialias=antialias
            )
        if self.do_normalize:
            mean = torch.tensor(self.image_mean)
            std = torch.tensor(self.image_std)
            if self.do_rescale:
                mean = mean * (1.0 / self.rescale_factor)
                std = std * (1.0 / self.rescale_factor)
            pixels = video.to(torch.float32).sub_(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))
        elif self.do_rescale:
            pixels = video * self.rescale_factor
        else:
            pixels = video.to(torch.float32)
        return self._patchify(pixels)

    def _patchify(self, video: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
        p, m, tps = self.patch_size, self.merge_size, self.temporal_patch_size
        if pad := -video.shape[0] % tps:
            video = torch.cat([video, video[-1:].expand(pad, -1, -1, -1)])
        num_frames, channels, height, width = video.shape
        grid_t, grid_h, grid_w = num_frames // tps, height // p, width // p
        patches = video.reshape(grid_t, tps, channels, grid_h // m, m, p, grid_w // m, m, p)
        # -> (t, h-blocks, w-blocks, h-in-block, w-in-block, C, tps, p, p)
        patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        flat = patches.reshape(grid_t * grid_h * grid_w, channels * tps * p * p)
        return flat, (grid_t, grid_h, grid_w)
