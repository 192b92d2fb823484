"""Where a checkpoint keeps its image, video and audio processor settings.

Two layouts are in use, and transformers 5.24 reads both:

- transformers 5 (``ProcessorMixin.save_pretrained``): one
  ``processor_config.json`` whose ``image_processor`` / ``video_processor`` /
  ``feature_extractor`` blocks hold each sub-processor's settings;
- legacy (transformers 4, most published checkpoints): flat
  ``preprocessor_config.json`` (image processor and audio feature extractor,
  often both in one file) and ``video_preprocessor_config.json``.

Precedence, as in transformers' ``get_image_processor_dict`` /
``get_video_processor_dict`` / ``get_feature_extractor_dict``: the nested
block wins when ``processor_config.json`` has one; otherwise the first legacy
file present. A video processor without settings of its own falls back to
the image processor's ``preprocessor_config.json``; an audio block may also be
spelled ``audio_processor``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["PROCESSOR_CONFIG", "ProcessorSettings", "processor_settings"]

PROCESSOR_CONFIG = "processor_config.json"
Kind = Literal["image", "video", "audio"]

_NESTED_KEYS: dict[str, tuple[str, ...]] = {
    "image": ("image_processor",),
    "video": ("video_processor",),
    "audio": ("feature_extractor", "audio_processor"),
}
_LEGACY_FILES: dict[str, tuple[str, ...]] = {
    "image": ("preprocessor_config.json",),
    "video": ("video_preprocessor_config.json", "preprocessor_config.json"),
    "audio": ("preprocessor_config.json",),
}


@dataclass(frozen=True)
class ProcessorSettings:
    """One sub-processor's settings and where they came from."""

    values: dict[str, Any]
    source: str  # e.g. "processor_config.json[video_processor]" or "preprocessor_config.json"


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def processor_settings(model_path: str | os.PathLike, kind: Kind) -> ProcessorSettings | None:
    """The ``kind`` processor's settings in the checkpoint folder, in
    transformers' order of precedence, or ``None`` when it has none."""
    path = os.fspath(model_path)
    nested_file = os.path.join(path, PROCESSOR_CONFIG)
    if os.path.isfile(nested_file):
        nested = _read_json(nested_file)
        for key in _NESTED_KEYS[kind]:
            block = nested.get(key)
            if block is not None:
                if not isinstance(block, dict):
                    raise ValueError(f"{nested_file}: {key!r} must be an object, got {type(block).__name__}")
                return ProcessorSettings(dict(block), f"{PROCESSOR_CONFIG}[{key}]")
    for name in _LEGACY_FILES[kind]:
        file = os.path.join(path, name)
        if os.path.isfile(file):
            return ProcessorSettings(_read_json(file), name)
    return None
