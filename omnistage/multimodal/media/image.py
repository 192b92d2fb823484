"""Images: a PIL image, a uint8 array, or encoded bytes from any source."""

from __future__ import annotations

import io
import warnings
from typing import Any

import numpy as np
import torch
from PIL import Image

from omnistage.multimodal.media.source import OFFLINE, MediaError, MediaLimits, read_media_bytes

__all__ = ["decode_image_bytes", "load_image"]


def _check_pixels(width: int, height: int, where: str, limits: MediaLimits) -> None:
    if width <= 0 or height <= 0:
        raise MediaError(where, f"the image is empty ({width}x{height})", "invalid_image")
    if limits.max_image_pixels is not None and width * height > limits.max_image_pixels:
        raise MediaError(
            where,
            f"image is {width}x{height} = {width * height} pixels, over the limit of {limits.max_image_pixels}",
            "image_too_large",
        )


def _undecodable(data: bytes, where: str, exc: Exception) -> MediaError:
    return MediaError(where, f"could not decode image data ({len(data)} bytes): {exc}", "invalid_image")


def decode_image_bytes(data: bytes, where: str = "image item 0", limits: MediaLimits = OFFLINE) -> Image.Image:
    """Decode encoded image bytes (any format PIL reads) to a loaded image,
    checking the pixel count from the header before decoding the pixels."""
    with warnings.catch_warnings():
        if limits.max_image_pixels is not None:  # our own bound governs, PIL's warning is noise
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data))
        except Image.DecompressionBombError as exc:
            raise MediaError(where, f"image is too large to decode ({exc})", "image_too_large") from None
        except (OSError, ValueError, SyntaxError) as exc:  # UnidentifiedImageError is an OSError
            raise _undecodable(data, where, exc) from None
        _check_pixels(image.width, image.height, where, limits)
        try:
            image.load()  # a truncated file fails here, not later inside a model processor
        except (OSError, ValueError, SyntaxError) as exc:
            raise _undecodable(data, where, exc) from None
    return image


def load_image(source: Any, where: str = "image item 0", limits: MediaLimits = OFFLINE) -> Image.Image:
    """A fully loaded PIL image from a PIL image, an ``[H, W]`` / ``[H, W, C]``
    uint8 array or tensor (C in 1, 3, 4), or encoded bytes / data URL / path."""
    if isinstance(source, Image.Image):
        try:
            source.load()  # a lazily opened, truncated file
        except OSError as exc:
            raise MediaError(where, f"could not decode image data: {exc}", "invalid_image") from None
        _check_pixels(source.width, source.height, where, limits)
        return source
    if isinstance(source, (np.ndarray, torch.Tensor)):
        array = source.detach().cpu().numpy() if isinstance(source, torch.Tensor) else source
        if array.dtype != np.uint8 or array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[2] not in (1, 3, 4)):
            raise MediaError(
                where,
                f"expected a uint8 array of shape [H, W] or [H, W, C] with C in (1, 3, 4), "
                f"got {array.dtype} {tuple(array.shape)}",
                "invalid_image",
            )
        _check_pixels(array.shape[1], array.shape[0], where, limits)
        return Image.fromarray(array[..., 0] if array.ndim == 3 and array.shape[2] == 1 else array)
    if isinstance(source, (str, bytes, bytearray, memoryview)):
        return decode_image_bytes(read_media_bytes(source, "image", where, limits), where, limits)
    raise MediaError(
        where,
        f"expected a PIL image, a data URL, a local path, bytes or a uint8 array, got {type(source).__name__}",
        "invalid_image",
    )
