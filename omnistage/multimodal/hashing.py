"""Content identifiers for multimodal items.

An item's identifier keys the encoder cache and enters the KV prefix-cache
block hashes, so it must be equal exactly when the encoder output and the
placeholder layout would be equal. It is a SHA-256 over:

- the modality;
- the *decoded* content: pixels of an image (PIL mode, size and bytes), the
  frames of a video (dtype, shape and bytes of the uint8 array), the samples
  of an audio clip (dtype, shape, bytes and sample rate), never the encoded
  file bytes, so a PNG and a JPEG of different pixels never collide and the
  same pixels reached through a path, a data URL or a PIL object share;
- the processing options that change the processed tensors or positions
  (resize limits, fps, ...), as canonical JSON.

Every field is written with a tag and a length prefix, so no two different
field sequences produce the same byte stream.

A request with a ``cache_salt`` gets its items' identifiers salted
(:func:`salt_identifier`): tenants with different salts then share neither KV
blocks nor encoder outputs, so a cache hit's speed cannot reveal to one
tenant what media another sent.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from PIL import Image

__all__ = ["MultiModalHasher", "hash_audio", "hash_image", "hash_item", "hash_video", "salt_identifier"]


class MultiModalHasher:
    """Incremental, unambiguous SHA-256 over tagged fields."""

    def __init__(self, modality: str) -> None:
        self._sha = hashlib.sha256()
        self.add_bytes("modality", modality.encode())

    def add_bytes(self, tag: str, data: bytes | memoryview) -> None:
        tag_bytes = tag.encode()
        self._sha.update(len(tag_bytes).to_bytes(2, "little"))
        self._sha.update(tag_bytes)
        self._sha.update(len(data).to_bytes(8, "little"))
        self._sha.update(data)

    def add_array(self, tag: str, array: np.ndarray | torch.Tensor) -> None:
        """Dtype, shape and the C-order bytes of an array or tensor."""
        if isinstance(array, torch.Tensor):
            array = array.detach().cpu()
            if array.dtype == torch.bfloat16:  # NumPy has no bfloat16: hash the raw bits
                dtype_name = "bfloat16"
                array = array.contiguous().view(torch.int16).numpy()
            else:
                array = array.contiguous().numpy()
                dtype_name = array.dtype.str
        else:
            array = np.asarray(array)
            dtype_name = array.dtype.str
        if array.dtype == object:
            raise ValueError("cannot hash an object array; expected numeric data")
        self.add_bytes(f"{tag}.dtype", dtype_name.encode())
        self.add_bytes(f"{tag}.shape", json.dumps(list(array.shape)).encode())
        self.add_bytes(f"{tag}.data", memoryview(np.ascontiguousarray(array)).cast("B"))

    def add_image(self, tag: str, image: Image.Image) -> None:
        """Mode, size and decoded pixel bytes of a PIL image."""
        image.load()
        self.add_bytes(f"{tag}.mode", image.mode.encode())
        self.add_bytes(f"{tag}.size", json.dumps(list(image.size)).encode())
        if image.mode == "P":  # the palette is part of the pixels' meaning
            self.add_bytes(f"{tag}.palette", bytes(image.getpalette() or []))
        transparency = image.info.get("transparency")  # so is a transparent colour: converted to RGB, it is white
        if transparency is not None:
            value = transparency if isinstance(transparency, bytes) else _canonical_json(transparency).encode()
            self.add_bytes(f"{tag}.transparency", value)
        self.add_bytes(f"{tag}.data", image.tobytes())

    def add_options(self, options: Mapping[str, Any] | None) -> None:
        self.add_bytes("options", _canonical_json(options or {}).encode())

    def hexdigest(self) -> str:
        return self._sha.hexdigest()


def _to_jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_jsonable(v) for v in value]
    if isinstance(value, (np.generic,)):
        return value.item()
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)  # enums and the like: their repr names them


def _canonical_json(options: Mapping[str, Any]) -> str:
    return json.dumps(_to_jsonable(options), sort_keys=True, separators=(",", ":"), allow_nan=True)


def hash_image(image: Image.Image, options: Mapping[str, Any] | None = None) -> str:
    hasher = MultiModalHasher("image")
    hasher.add_image("pixels", image)
    hasher.add_options(options)
    return hasher.hexdigest()


def hash_video(frames: np.ndarray | torch.Tensor, options: Mapping[str, Any] | None = None) -> str:
    hasher = MultiModalHasher("video")
    hasher.add_array("frames", frames)
    hasher.add_options(options)
    return hasher.hexdigest()


def hash_audio(
    waveform: np.ndarray | torch.Tensor, sample_rate: int | float, options: Mapping[str, Any] | None = None
) -> str:
    hasher = MultiModalHasher("audio")
    hasher.add_array("samples", waveform)
    hasher.add_bytes("sample_rate", repr(float(sample_rate)).encode())
    hasher.add_options(options)
    return hasher.hexdigest()


def hash_item(modality: str, content: Any, options: Mapping[str, Any] | None = None) -> str:
    """Identifier of one decoded item: a PIL image, a video frames array, or
    an audio ``(waveform, sample_rate)`` pair."""
    if modality == "image":
        if isinstance(content, Image.Image):
            return hash_image(content, options)
        hasher = MultiModalHasher("image")
        hasher.add_array("pixels", content)
        hasher.add_options(options)
        return hasher.hexdigest()
    if modality == "video":
        return hash_video(content, options)
    if modality == "audio":
        waveform, sample_rate = content
        return hash_audio(waveform, sample_rate, options)
    hasher = MultiModalHasher(modality)
    hasher.add_array("data", content)
    hasher.add_options(options)
    return hasher.hexdigest()


def salt_identifier(identifier: str, cache_salt: str) -> str:
    """The identifier of an item in a request salted with ``cache_salt``."""
    hasher = MultiModalHasher("salted")
    hasher.add_bytes("salt", cache_salt.encode())
    hasher.add_bytes("identifier", identifier.encode())
    return hasher.hexdigest()
