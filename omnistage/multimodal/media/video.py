"""Video: decoded frames only (there is no video codec library in the environment)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from omnistage.multimodal.media.image import load_image
from omnistage.multimodal.media.source import OFFLINE, MediaError, MediaLimits

__all__ = ["DecodedVideo", "load_video"]


@dataclass
class DecodedVideo:
    frames: np.ndarray  # uint8 [T, H, W, 3]
    metadata: dict[str, Any] = field(default_factory=dict)  # e.g. {"fps": 2.0}


def _invalid(where: str, detail: str) -> MediaError:
    return MediaError(where, detail, "invalid_video")


def load_video(source: Any, where: str = "video item 0", limits: MediaLimits = OFFLINE) -> DecodedVideo:
    """Frames as a uint8 ``[T, H, W, 3]`` array (grey frames are replicated
    to RGB, as transformers' video processor does), plus metadata. ``source``
    is a ``[T, H, W, 3]`` / ``[T, H, W]`` uint8 array or tensor, or a list of
    images (each decoded by ``load_image``), optionally as ``(frames, {"fps": x})``.
    ``limits.max_image_pixels`` bounds each frame."""
    metadata: dict[str, Any] = {}
    if isinstance(source, tuple) and len(source) == 2 and isinstance(source[1], Mapping):
        source, metadata = source[0], dict(source[1])
    if isinstance(source, (list, tuple)):
        if not source:
            raise _invalid(where, "the frame list is empty; expected at least one frame")
        frames = [np.asarray(load_image(f, f"{where} frame {k}", limits).convert("RGB")) for k, f in enumerate(source)]
        if len({f.shape for f in frames}) != 1:
            sizes = sorted({f.shape for f in frames})
            raise _invalid(where, f"frames differ in size ({sizes}); expected equal sizes")
        array = np.stack(frames)
    elif isinstance(source, (np.ndarray, torch.Tensor)):
        array = source.detach().cpu().numpy() if isinstance(source, torch.Tensor) else source
        if array.dtype != np.uint8:
            raise _invalid(where, f"expected uint8 frames, got dtype {array.dtype}")
        if array.ndim == 3:
            array = array[..., None]
        if array.ndim != 4 or array.shape[-1] not in (1, 3):
            raise _invalid(
                where, f"expected frames of shape [T, H, W, 3] (or [T, H, W] grey), got {tuple(source.shape)}"
            )
        if array.shape[-1] == 1:
            array = np.repeat(array, 3, axis=-1)
    else:
        raise _invalid(
            where,
            f"expected a uint8 frames array [T, H, W, 3] or a list of frames "
            f"(optionally as (frames, metadata)), got {type(source).__name__}",
        )
    if 0 in array.shape:
        raise _invalid(where, f"the video is empty (shape {tuple(array.shape)})")
    height, width = array.shape[1:3]
    if limits.max_image_pixels is not None and height * width > limits.max_image_pixels:
        raise MediaError(
            where,
            f"frames are {width}x{height} = {width * height} pixels, over the limit of {limits.max_image_pixels}",
            "image_too_large",
        )
    fps = metadata.get("fps")
    if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or not 0 < fps < math.inf):
        raise _invalid(where, f"metadata fps must be a positive finite number, got {fps!r}")
    return DecodedVideo(np.ascontiguousarray(array), metadata)
