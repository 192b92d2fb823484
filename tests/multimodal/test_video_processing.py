"""Our torchvision-free Qwen2-VL video preprocessing against transformers' own
``Qwen2VLVideoProcessor`` code, run without torchvision (see omnistage/testing/hf_processors.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omnistage.multimodal.video_processing import QwenVideoPreprocessor, smart_resize
from omnistage.testing.hf_processors import hf_qwen2_vl_video_processor


@pytest.fixture(scope="module")
def hf_video_processor_class():
    """transformers' Qwen2VLVideoProcessor, loaded from its source (see omnistage/testing/hf_processors.py)."""
    with hf_qwen2_vl_video_processor() as cls:
        yield cls


SIZE = {"shortest_edge": 4 * 28 * 28, "longest_edge": 16 * 28 * 28}


@pytest.mark.parametrize(
    "shape, cap",
    [
        ((2, 56, 84, 3), False),  # already on the grid: no resize
        ((3, 50, 70, 3), False),  # bicubic resize + frame padding (3 -> 4)
        ((4, 200, 120, 3), False),  # downscale to the pixel limit
        ((1, 30, 30, 3), False),  # upscale to the minimum, one frame padded to two
        ((6, 100, 100, 3), True),  # per-frame cap from the total-video budget
    ],
)
def test_bit_identical_to_transformers(hf_video_processor_class, shape, cap):
    frames = np.random.default_rng(sum(shape)).integers(0, 256, shape, dtype=np.uint8)
    hf = hf_video_processor_class(size=dict(SIZE), patch_size=14, temporal_patch_size=2, merge_size=2)
    kwargs = {"max_video_tokens": 40} if cap else {}
    if cap:
        hf.max_video_tokens = 40
    expected = hf(videos=[frames], return_tensors="pt", cap_pixels_per_frame=cap)
    ours = QwenVideoPreprocessor(size=dict(SIZE), cap_pixels_per_frame=cap, **kwargs)
    pixels, grid = ours(frames)
    assert list(grid) == expected["video_grid_thw"][0].tolist()
    assert pixels.dtype == torch.float32
    assert torch.equal(pixels, expected["pixel_values_videos"])
    assert ours.grid_thw(shape[0], shape[1], shape[2]) == grid


def test_smart_resize_matches_transformers():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

    rng = np.random.default_rng(0)
    for _ in range(300):
        h, w = (int(v) for v in rng.integers(10, 3000, 2))
        if max(h, w) / min(h, w) > 200:
            continue
        args = (28, 56 * 56, 28 * 28 * 1280)
        assert smart_resize(h, w, *args) == hf_smart_resize(h, w, *args)
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 3000, 28, 56 * 56, 28 * 28 * 1280)


def test_frames_equal_to_an_image_match_the_image_processor_closely():
    """Two equal frames on the grid are patchified like a still image (which
    the image processor repeats over the temporal patch); only the
    normalization arithmetic differs (fused in float32 vs PIL backend)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    frame = np.random.default_rng(3).integers(0, 256, (56, 84, 3), dtype=np.uint8)
    video = np.stack([frame, frame])
    pixels, grid = QwenVideoPreprocessor(size=dict(SIZE))(video)
    image = Qwen2VLImageProcessorPil(size=dict(SIZE))(images=[frame], return_tensors="pt")
    assert list(grid) == image["image_grid_thw"][0].tolist()
    torch.testing.assert_close(pixels, image["pixel_values"], atol=1e-5, rtol=1e-5)


def test_config_loading_and_options(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text('{"min_pixels": 1000, "max_pixels": 9000, "merge_size": 2}')
    p = QwenVideoPreprocessor.from_pretrained(tmp_path)
    assert p.size == {"shortest_edge": 1000, "longest_edge": 9000}
    q = p.with_options({"max_pixels": 5000})
    assert q.size == {"shortest_edge": 1000, "longest_edge": 5000} and p.size["longest_edge"] == 9000
    assert QwenVideoPreprocessor.from_pretrained(tmp_path / "missing").patch_size == 14
    with pytest.raises(ValueError, match="resample mode 1"):
        QwenVideoPreprocessor(size=dict(SIZE), resample=1)(np.zeros((2, 30, 30, 3), dtype=np.uint8))
