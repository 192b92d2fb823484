"""Processor settings are read from both layouts transformers reads (issue 12).

A checkpoint's processor files are rewritten by transformers' own
``save_pretrained``: the whole processor's (transformers 5: one
``processor_config.json`` with nested blocks) or each sub-processor's
(legacy: ``preprocessor_config.json`` + ``video_preprocessor_config.json``).
omnistage's processing of the folder must then equal transformers'
processor loaded from the same folder by transformers' own loaders. The
video bounds are restrictive (at most 16 merged tokens per frame pair), so
settings that fall back to class defaults show as a different token count.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

from omnistage.multimodal.processing import MultiModalProcessor
from omnistage.multimodal.processor_config import processor_settings
from omnistage.multimodal.video_processing import QwenVideoPreprocessor
from omnistage.testing.hf_processors import (
    hf_processor_from_pretrained,
    hf_qwen2_vl_video_processor,
    resave_processor_with_transformers,
)
from omnistage.testing.tiny_mm_checkpoints import (
    PROCESSOR_LAYOUTS,
    write_tiny_qwen2_5_omni_thinker,
    write_tiny_qwen2_5_vl,
)

_FILES = ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json")
U = 28 * 28  # pixels of one merged token


@pytest.fixture(scope="module")
def video_cls():
    with hf_qwen2_vl_video_processor() as cls:
        yield cls


def _image(seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (60, 90, 3), dtype=np.uint8))


def _video(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (4, 56, 84, 3), dtype=np.uint8)


def _prompt(proc: MultiModalProcessor, *parts: str) -> str:
    content = [{"type": p} for p in parts] + [{"type": "text", "text": "describe"}]
    return proc.apply_chat_template([{"role": "user", "content": content}])


@pytest.mark.parametrize("layout", PROCESSOR_LAYOUTS)
def test_vl_processing_equals_transformers_in_each_layout(tmp_path, video_cls, layout):
    path = write_tiny_qwen2_5_vl(tmp_path / "vl")
    resave_processor_with_transformers(path, layout, video_cls)
    written = set(os.listdir(path)) & set(_FILES)
    assert written == ({"processor_config.json"} if layout == "nested" else set(_FILES[1:]))

    ours = MultiModalProcessor.from_pretrained(path)
    hf = hf_processor_from_pretrained(path, video_cls)
    hf_size = dict(hf.video_processor.size)
    assert (hf_size["shortest_edge"], hf_size["longest_edge"]) == (4 * U, 16 * U)  # transformers reads it back
    assert ours.video_processor.size == {"shortest_edge": 4 * U, "longest_edge": 16 * U}
    prompt = _prompt(ours, "video", "image")
    frames, picture = _video(0), _image(1)
    expected = hf(text=[prompt], images=[picture], videos=[frames], return_tensors="pt")
    out = ours.process({"prompt": prompt, "multi_modal_data": {"video": frames, "image": picture}})
    video, image = out.mm_features

    # 4 frames of 56x84 = 2 frame pairs of 2x3 merged tokens; class defaults would give 280
    assert video.mm_position.length == 12
    assert out.prompt_token_ids == expected["input_ids"][0].tolist()
    assert torch.equal(video.data["video_grid_thw"], expected["video_grid_thw"])
    assert torch.equal(video.data["pixel_values_videos"], expected["pixel_values_videos"])
    assert torch.equal(image.data["image_grid_thw"], expected["image_grid_thw"])
    assert torch.equal(image.data["pixel_values"], expected["pixel_values"])
    torch.testing.assert_close(video.data["second_per_grid_ts"], expected["second_per_grid_ts"].float())


@pytest.mark.parametrize("layout", PROCESSOR_LAYOUTS)
def test_omni_settings_equal_transformers_in_each_layout(tmp_path, video_cls, layout):
    """Image, audio and video processing equal transformers' processor. Its video
    processor reads the checkpoint's own (restrictive) bounds back, but Qwen2.5-Omni's
    processor passes its fixed video size on every call, so that size is the one
    that applies, in omnistage too."""
    path = write_tiny_qwen2_5_omni_thinker(tmp_path / "omni")
    resave_processor_with_transformers(path, layout, video_cls)
    ours = MultiModalProcessor.from_pretrained(path)
    hf = hf_processor_from_pretrained(path, video_cls)

    hf_size = dict(hf.video_processor.size)
    assert (hf_size["shortest_edge"], hf_size["longest_edge"]) == (4 * U, 16 * U)  # read back, then overridden
    assert ours.video_processor.size == type(hf).videos_kwargs["size"]
    for key in ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std", "rescale_factor"):
        theirs = getattr(hf.video_processor, key)
        assert getattr(ours.video_processor, key) == (list(theirs) if isinstance(theirs, tuple) else theirs), key

    prompt = _prompt(ours, "image", "audio", "video")
    clip = (np.random.default_rng(2).standard_normal(16000) * 0.1).astype(np.float32)
    frames = _video(4)
    expected = hf(text=[prompt], images=[_image(3)], audio=[clip], videos=[frames], return_tensors="pt")
    out = ours.process(
        {"prompt": prompt, "multi_modal_data": {"image": _image(3), "audio": (clip, 16000), "video": frames}}
    )
    image, audio, video = out.mm_features
    assert out.prompt_token_ids == expected["input_ids"][0].tolist()
    assert torch.equal(image.data["pixel_values"], expected["pixel_values"])
    n = int(expected["feature_attention_mask"][0].sum())
    assert torch.equal(audio.data["input_features"], expected["input_features"][0, :, :n])
    assert torch.equal(video.data["video_grid_thw"], expected["video_grid_thw"])
    assert torch.equal(video.data["pixel_values_videos"], expected["pixel_values_videos"])


def _write(path, name: str, data: dict) -> None:
    (path / name).write_text(json.dumps(data))


def test_settings_precedence_follows_transformers(tmp_path):
    """Nested block first, then the legacy files; a video processor borrows
    the image file only when it has nothing of its own; audio may be spelled
    ``audio_processor``."""
    assert processor_settings(tmp_path, "video") is None
    assert QwenVideoPreprocessor.from_pretrained(tmp_path) == QwenVideoPreprocessor()

    _write(tmp_path, "preprocessor_config.json", {"max_pixels": 1000, "sampling_rate": 8000})
    borrowed = processor_settings(tmp_path, "video")
    assert borrowed.source == "preprocessor_config.json" and borrowed.values["max_pixels"] == 1000
    _write(tmp_path, "video_preprocessor_config.json", {"max_pixels": 2000})
    assert processor_settings(tmp_path, "video").values == {"max_pixels": 2000}

    # a processor_config.json without nested blocks (older transformers 4
    # processors wrote one) leaves the legacy files in charge
    _write(tmp_path, "processor_config.json", {"processor_class": "Qwen2_5_VLProcessor"})
    assert processor_settings(tmp_path, "video").source == "video_preprocessor_config.json"

    _write(
        tmp_path,
        "processor_config.json",
        {"video_processor": {"max_pixels": 3000}, "audio_processor": {"sampling_rate": 24000}},
    )
    assert processor_settings(tmp_path, "video").values == {"max_pixels": 3000}
    assert processor_settings(tmp_path, "video").source == "processor_config.json[video_processor]"
    assert processor_settings(tmp_path, "audio").values == {"sampling_rate": 24000}
    assert processor_settings(tmp_path, "image").values["max_pixels"] == 1000  # no image block: legacy file
    assert QwenVideoPreprocessor.from_pretrained(tmp_path).size["longest_edge"] == 3000


def test_unreadable_settings_name_the_file(tmp_path):
    (tmp_path / "processor_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"processor_config.json: not valid JSON"):
        processor_settings(tmp_path, "video")
    _write(tmp_path, "processor_config.json", {"video_processor": [1, 2]})
    with pytest.raises(ValueError, match=r"'video_processor' must be an object, got list"):
        processor_settings(tmp_path, "video")


@pytest.mark.parametrize("layout", PROCESSOR_LAYOUTS)
def test_tiny_writers_write_the_layout(tmp_path, layout):
    path = write_tiny_qwen2_5_vl(tmp_path / "vl", processor_layout=layout)
    files = set(os.listdir(path)) & set(_FILES)
    assert files == ({"processor_config.json"} if layout == "nested" else set(_FILES[1:]))
    assert MultiModalProcessor.from_pretrained(path).video_processor.size["longest_edge"] == 16 * U
    with pytest.raises(ValueError, match="processor_layout 'flat'"):
        write_tiny_qwen2_5_vl(tmp_path / "bad", processor_layout="flat")
