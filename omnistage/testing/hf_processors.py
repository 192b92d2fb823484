"""transformers' Qwen2.5-VL / Qwen2.5-Omni processors without torchvision, as a test reference.

transformers' video processor module imports torchvision, which cannot be
installed beside our torch. To run its code anyway, :func:`hf_qwen2_vl_video_processor`
loads the module's source with a stand-in for the two torchvision kernels that
path calls on CPU (``resize``: a native uint8 ``interpolate`` with
antialiasing, no-op at equal size; ``normalize``: ``sub(mean).div_(std)``),
written from torchvision's source. Everything else (order of operations, smart
resize, fused mean/std, frame padding, patch layout, config loading and
saving) is transformers' code.

:func:`hf_processor_from_pretrained` assembles the whole processor from a
checkpoint folder the way its ``from_pretrained`` does (transformers' loader
per sub-processor); :func:`resave_processor_with_transformers` rewrites a
folder's processor files with transformers' own ``save_pretrained``, in the
transformers 5 layout or the legacy one.
"""

from __future__ import annotations

import enum
import importlib.util
import json
import os
import sys
import types
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any
from unittest import mock

import torch

__all__ = ["hf_processor_from_pretrained", "hf_qwen2_vl_video_processor", "resave_processor_with_transformers"]

_PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json")


class _InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def _tv_resize(image, size, interpolation=_InterpolationMode.BILINEAR, antialias=True, **_):
    # torchvision.transforms.v2.functional.resize_image on CPU, bicubic uint8
    if tuple(image.shape[-2:]) == tuple(size):
        return image
    shape = image.shape
    flat = image.reshape(-1, *shape[-3:])
    out = torch.nn.functional.interpolate(
        flat, size=list(size), mode=interpolation.value, align_corners=False, antialias=antialias
    )
    return out.reshape(*shape[:-2], *size)


def _tv_normalize(image, mean, std, inplace=False):
    mean = torch.as_tensor(mean, dtype=image.dtype).view(-1, 1, 1)
    std = torch.as_tensor(std, dtype=image.dtype).view(-1, 1, 1)
    image = image.sub_(mean) if inplace else image.sub(mean)
    return image.div_(std)


@contextmanager
def hf_qwen2_vl_video_processor() -> Iterator[Any]:
    """transformers' ``Qwen2VLVideoProcessor`` class, loaded from its source,
    usable (and accepted by transformers' processors) inside the ``with``."""
    import transformers.image_processing_backends as backends
    import transformers.processing_utils as processing_utils
    import transformers.models.qwen2_vl as qwen2_vl_pkg
    import transformers.video_processing_utils as video_utils

    with ExitStack() as patches:
        try:
            import torchvision  # noqa: F401  (a real one, if ever installed: use it)
        except ImportError:
            tvF = types.SimpleNamespace(
                resize=_tv_resize,
                normalize=_tv_normalize,
                InterpolationMode=_InterpolationMode,
                grayscale_to_rgb=lambda x: x,
            )
            v2 = types.ModuleType("torchvision.transforms.v2")
            v2.functional = tvF
            stand_ins = {
                "torchvision": types.ModuleType("torchvision"),
                "torchvision.transforms": types.ModuleType("torchvision.transforms"),
                "torchvision.transforms.v2": v2,
                "torchvision.transforms.v2.functional": tvF,
            }
            patches.enter_context(mock.patch.dict(sys.modules, stand_ins))
            for owner, name, value in [
                (backends, "tvF", tvF),
                (video_utils, "tvF", tvF),
                (backends, "pil_torch_interpolation_mapping", {3: _InterpolationMode.BICUBIC}),
                # processors check their video processor against this base class, looked up by name
                (processing_utils.transformers_module, "VideoProcessorMixin", video_utils.VideoProcessorMixin),
            ]:
                patches.enter_context(mock.patch.object(owner, name, value, create=True))
        name = "transformers.models.qwen2_vl._omnistage_test_video_processing"
        spec = importlib.util.spec_from_file_location(
            name, os.path.join(os.path.dirname(qwen2_vl_pkg.__file__), "video_processing_qwen2_vl.py")
        )
        module = importlib.util.module_from_spec(spec)
        patches.enter_context(mock.patch.dict(sys.modules, {name: module}))
        spec.loader.exec_module(module)
        yield module.Qwen2VLVideoProcessor


def _is_omni(path: str | os.PathLike) -> bool:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)["model_type"] != "qwen2_5_vl"


def _processor_class(is_omni: bool) -> Any:
    from transformers import Qwen2_5_VLProcessor, Qwen2_5OmniProcessor

    return Qwen2_5OmniProcessor if is_omni else Qwen2_5_VLProcessor


def _sub_processors(path: str | os.PathLike, video_cls: Any, is_omni: bool) -> dict[str, Any]:
    """Each sub-processor loaded by transformers' own loader (the image
    processor with the PIL backend, as omnistage uses it)."""
    from transformers import AutoFeatureExtractor, AutoImageProcessor, AutoTokenizer

    parts = {
        "image_processor": AutoImageProcessor.from_pretrained(path, backend="pil"),
        "video_processor": video_cls.from_pretrained(path),
        "tokenizer": AutoTokenizer.from_pretrained(path),
    }
    if is_omni:
        parts["feature_extractor"] = AutoFeatureExtractor.from_pretrained(path)
    return parts


def hf_processor_from_pretrained(path: str | os.PathLike, video_cls: Any) -> Any:
    """transformers' ``Qwen2_5_VLProcessor`` / ``Qwen2_5OmniProcessor`` for a
    checkpoint folder, assembled as its ``from_pretrained`` does; ``video_cls``
    comes from :func:`hf_qwen2_vl_video_processor`."""
    is_omni = _is_omni(path)
    parts = _sub_processors(path, video_cls, is_omni)
    return _processor_class(is_omni)(**parts, chat_template=parts["tokenizer"].chat_template)


def resave_processor_with_transformers(path: str | os.PathLike, layout: str, video_cls: Any) -> None:
    """Load the folder's processor with transformers' loaders, delete its
    processor files and save it again with transformers' ``save_pretrained``:
    ``layout="nested"`` saves the whole processor (one ``processor_config.json``,
    as transformers 5 does), ``"legacy"`` each sub-processor on its own
    (``preprocessor_config.json``, ``video_preprocessor_config.json``; for
    Qwen2.5-Omni the image and audio settings share the first, as in the
    published checkpoint)."""
    is_omni = _is_omni(path)
    parts = _sub_processors(path, video_cls, is_omni)
    for name in _PROCESSOR_FILES:
        if os.path.exists(os.path.join(path, name)):
            os.remove(os.path.join(path, name))
    if layout == "nested":
        _processor_class(is_omni)(**parts, chat_template=parts["tokenizer"].chat_template).save_pretrained(path)
    elif layout == "legacy":
        if is_omni:
            merged = {**parts["feature_extractor"].to_dict(), **parts["image_processor"].to_dict()}
            merged.pop("mel_filters", None)  # derived from the other settings, not saved
            with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
                json.dump(merged, f, indent=2, sort_keys=True)
        else:
            parts["image_processor"].save_pretrained(path)
        parts["video_processor"].save_pretrained(path)
    else:
        raise ValueError(f"layout {layout!r}: expected 'nested' or 'legacy'")
