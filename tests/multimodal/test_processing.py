"""Prompt + media -> token ids + feature specs, against transformers' own
processors on tiny checkpoints."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from omnistage.testing.tiny_mm_checkpoints import write_tiny_qwen2_5_omni_thinker, write_tiny_qwen2_5_vl
from omnistage.multimodal.processing import MultiModalProcessor, audio_output_length


@pytest.fixture(scope="module")
def vl(tmp_path_factory) -> MultiModalProcessor:
    return MultiModalProcessor.from_pretrained(write_tiny_qwen2_5_vl(tmp_path_factory.mktemp("vl")))


@pytest.fixture(scope="module")
def omni(tmp_path_factory) -> MultiModalProcessor:
    return MultiModalProcessor.from_pretrained(write_tiny_qwen2_5_omni_thinker(tmp_path_factory.mktemp("omni")))


def image(seed: int, h: int = 60, w: int = 90) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def clip(seed: int, seconds: float) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(int(16000 * seconds)) * 0.1).astype(np.float32)


def chat(proc: MultiModalProcessor, *parts: str) -> str:
    content = [{"type": p} if p != "text" else {"type": "text", "text": "describe"} for p in parts]
    return proc.apply_chat_template([{"role": "user", "content": content}])


def hf_processor(proc: MultiModalProcessor):
    """transformers' processor class around the same components. Its
    constructor insists on a (torchvision) video processor, so it is assembled
    without it; image and audio processing run transformers' own code."""
    from transformers import Qwen2_5_VLProcessor, Qwen2_5OmniProcessor

    cls = Qwen2_5OmniProcessor if proc.is_omni else Qwen2_5_VLProcessor
    hf = object.__new__(cls)
    hf.image_processor, hf.tokenizer, hf.video_processor, hf.chat_template = (
        proc.image_processor, proc.tokenizer, None, None,
    )  # fmt: skip
    if proc.is_omni:
        hf.feature_extractor = proc.feature_extractor
        for name in ("image", "audio", "video"):
            setattr(hf, f"{name}_token", getattr(proc.tokenizer, f"{name}_token"))
            setattr(hf, f"{name}_token_id", getattr(proc.tokenizer, f"{name}_token_id"))
        for name in ("vision_bos", "vision_eos", "audio_bos", "audio_eos"):
            setattr(hf, f"{name}_token", getattr(proc.tokenizer, f"{name}_token"))
    else:
        hf.image_token, hf.video_token = "<|image_pad|>", "<|video_pad|>"
        hf.image_token_id, hf.video_token_id = proc.placeholder_ids["image"], proc.placeholder_ids["video"]
    return hf


def check_spans(out, proc: MultiModalProcessor) -> None:
    offsets = [f.mm_position.offset for f in out.mm_features]
    assert offsets == sorted(offsets)
    for f in out.mm_features:
        p = f.mm_position
        span = out.prompt_token_ids[p.offset : p.offset + p.length]
        assert span == [proc.placeholder_ids[f.modality]] * p.length
        assert p.is_embed is None
    for modality, pid in proc.placeholder_ids.items():
        total = sum(f.mm_position.length for f in out.mm_features if f.modality == modality)
        assert out.prompt_token_ids.count(pid) == total


def test_images_match_transformers_processor(vl):
    prompt = chat(vl, "image", "text", "image")
    images = [image(0), image(1, 300, 50)]
    expected = hf_processor(vl)(text=[prompt], images=images, return_tensors="pt")
    out = vl.process({"prompt": prompt, "multi_modal_data": {"image": images}})
    assert out.prompt_token_ids == expected["input_ids"][0].tolist()
    assert torch.equal(torch.cat([f.data["pixel_values"] for f in out.mm_features]), expected["pixel_values"])
    assert torch.equal(torch.cat([f.data["image_grid_thw"] for f in out.mm_features]), expected["image_grid_thw"])
    check_spans(out, vl)
    for f in out.mm_features:
        assert f.mm_position.length == int(f.data["image_grid_thw"].prod()) // 4
        assert f.mm_hash == f.identifier


def test_image_and_audio_match_transformers_omni_processor(omni):
    prompt = chat(omni, "image", "audio", "text", "audio")
    clips = [clip(0, 1.0), clip(1, 2.5)]
    expected = hf_processor(omni)(text=[prompt], images=[image(0)], audio=clips, return_tensors="pt")
    out = omni.process(
        {"prompt": prompt, "multi_modal_data": {"image": image(0), "audio": [(c, 16000) for c in clips]}}
    )
    assert out.prompt_token_ids == expected["input_ids"][0].tolist()
    assert [f.modality for f in out.mm_features] == ["image", "audio", "audio"]
    assert torch.equal(out.mm_features[0].data["pixel_values"], expected["pixel_values"])
    mask = expected["feature_attention_mask"]
    for k, f in enumerate(out.mm_features[1:]):
        n = int(mask[k].sum())
        assert torch.equal(f.data["input_features"], expected["input_features"][k, :, :n])
        assert f.data["audio_feature_lengths"].tolist() == [n]
        assert f.mm_position.length == audio_output_length(n)
    check_spans(out, omni)


def test_video_features_and_timing(vl, omni):
    frames = np.random.default_rng(5).integers(0, 256, (3, 56, 84, 3), dtype=np.uint8)
    out = vl.process({"prompt": chat(vl, "video", "text"), "multi_modal_data": {"video": frames}})
    (f,) = out.mm_features
    assert f.modality == "video" and f.data["video_grid_thw"].tolist() == [[2, 4, 6]]
    assert f.mm_position.length == 2 * 4 * 6 // 4
    assert f.data["pixel_values_videos"].shape == (48, 3 * 2 * 14 * 14)
    # without an fps the processors' defaults apply: 24 (Qwen2.5-VL), 2.0 (Omni)
    assert f.data["second_per_grid_ts"].tolist() == pytest.approx([2 / 24])
    (g,) = omni.process({"prompt": chat(omni, "video"), "multi_modal_data": {"video": frames}}).mm_features
    assert g.data["second_per_grid_ts"].tolist() == [1.0]
    (h,) = vl.process({"prompt": chat(vl, "video"), "multi_modal_data": {"video": (frames, {"fps": 4.0})}}).mm_features
    assert h.data["second_per_grid_ts"].tolist() == [0.5]
    assert h.identifier != f.identifier  # timing changes positions, so the key
    check_spans(out, vl)


def test_mixed_items_sorted_by_offset(omni):
    frames = np.random.default_rng(5).integers(0, 256, (2, 56, 56, 3), dtype=np.uint8)
    prompt = chat(omni, "audio", "image", "video", "text", "image")
    out = omni.process(
        {
            "prompt": prompt,
            "multi_modal_data": {"image": [image(0), image(1)], "video": frames, "audio": (clip(0, 0.5), 16000)},
        }
    )
    assert [f.modality for f in out.mm_features] == ["audio", "image", "video", "image"]
    check_spans(out, omni)


def test_identifiers_share_equal_content(vl):
    prompt = chat(vl, "image", "image", "image")
    out = vl.process({"prompt": prompt, "multi_modal_data": {"image": [image(0), image(1), image(0).copy()]}})
    a, b, c = (f.identifier for f in out.mm_features)
    assert a == c != b
    again = vl.process({"prompt": chat(vl, "image"), "multi_modal_data": {"image": image(0)}})
    assert again.mm_features[0].identifier == a  # across requests too


def test_processor_options(vl):
    big = image(0, 280, 280)
    default = vl.process({"prompt": chat(vl, "image"), "multi_modal_data": {"image": big}}).mm_features[0]
    small = vl.process(
        {
            "prompt": chat(vl, "image"),
            "multi_modal_data": {"image": big},
            "mm_processor_kwargs": {"images_kwargs": {"max_pixels": 16 * 28 * 28}},
        }
    ).mm_features[0]
    assert default.mm_position.length == 64 and small.mm_position.length == 16
    assert default.identifier != small.identifier
    with pytest.raises(ValueError, match="unsupported option"):
        vl.process({"prompt": chat(vl, "image"), "multi_modal_data": {"image": big},
                    "mm_processor_kwargs": {"images_kwargs": {"do_resize": False}}})  # fmt: skip
    with pytest.raises(ValueError, match="use_audio_in_video is not supported"):
        vl.process({"prompt": "x", "mm_processor_kwargs": {"use_audio_in_video": True}})


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ("big", r"mm_processor_kwargs: expected a dict, got str"),
        ({"images_kwargs": {"max_pixels": 0}}, r"images_kwargs\.max_pixels: expected a whole number of pixels"),
        ({"images_kwargs": {"max_pixels": "big"}}, r"images_kwargs\.max_pixels: expected a whole number"),
        ({"images_kwargs": {"min_pixels": 10**12}}, r"images_kwargs\.min_pixels: expected a whole number"),
        ({"images_kwargs": {"min_pixels": 2000, "max_pixels": 1000}}, r"min_pixels \(2000\) exceeds max_pixels"),
        ({"videos_kwargs": {"size": {"longest_edge": -1}}}, r"videos_kwargs\.size\.longest_edge: expected"),
        ({"videos_kwargs": {"size": {"edge": 10}}}, r"videos_kwargs\.size: expected \{'shortest_edge'"),
        ({"videos_kwargs": {"cap_pixels_per_frame": 1}}, r"cap_pixels_per_frame: expected true or false"),
        ({"fps": 0}, r"mm_processor_kwargs\.fps: expected a positive number of frames per second, got 0"),
        ({"fps": float("nan")}, r"mm_processor_kwargs\.fps: expected a positive number"),
        ({"fps": "abc"}, r"mm_processor_kwargs\.fps: expected a positive number"),
    ],
)
def test_bad_processor_options_are_named(vl, kwargs, message):
    """Each option is checked before any media is processed, and the error names it."""
    with pytest.raises(ValueError, match=message):
        vl.process({"prompt": chat(vl, "image"), "multi_modal_data": {"image": image(0)},
                    "mm_processor_kwargs": kwargs})  # fmt: skip


def test_prompt_token_ids_input(vl):
    prompt = chat(vl, "image")
    ids = vl.tokenizer(prompt)["input_ids"]
    a = vl.process({"prompt": prompt, "multi_modal_data": {"image": image(0)}})
    b = vl.process({"prompt_token_ids": ids, "multi_modal_data": {"image": image(0)}})
    assert a.prompt_token_ids == b.prompt_token_ids
    text_only = vl.process("hello")
    assert text_only.mm_features == [] and text_only.prompt_token_ids == vl.tokenizer("hello")["input_ids"]


def test_item_count_errors(vl):
    prompt = chat(vl, "image", "image")
    too_many = r"image item 2: the prompt has 2 <\|image_pad\|> placeholder\(s\) for 3 image item\(s\)"
    with pytest.raises(ValueError, match=too_many):
        vl.process({"prompt": prompt, "multi_modal_data": {"image": [image(0), image(1), image(2)]}})
    with pytest.raises(ValueError, match=r"image item 1: missing; the prompt has 2 <\|image_pad\|> placeholders but 1"):
        vl.process({"prompt": prompt, "multi_modal_data": {"image": [image(0)]}})
    with pytest.raises(ValueError, match=r"video item 0: the prompt has 0 <\|video_pad\|>"):
        frames = np.zeros((2, 28, 28, 3), np.uint8)
        vl.process({"prompt": prompt, "multi_modal_data": {"image": [image(0), image(1)], "video": frames}})
    with pytest.raises(ValueError, match="modality 'audio' is not supported by this model"):
        vl.process({"prompt": prompt, "multi_modal_data": {"audio": (clip(0, 1), 16000)}})


def test_bad_item_errors_name_the_item(vl, omni):
    with pytest.raises(ValueError, match="image item 1: could not decode image data"):
        vl.process({"prompt": chat(vl, "image", "image"), "multi_modal_data": {"image": [image(0), b"garbage"]}})
    with pytest.raises(ValueError, match=r"audio item 0: expected a mono waveform of shape \(num_samples,\)"):
        stereo = (np.zeros((2, 100), np.float32), 16000)
        omni.process({"prompt": chat(omni, "audio"), "multi_modal_data": {"audio": stereo}})
    with pytest.raises(ValueError, match="audio item 1: the clip is 31.00 s long"):
        omni.process({"prompt": chat(omni, "audio", "audio"),
                      "multi_modal_data": {"audio": [(clip(0, 1), 16000), (clip(1, 31), 16000)]}})  # fmt: skip
    with pytest.raises(ValueError, match="video item 0: expected uint8 frames"):
        vl.process({"prompt": chat(vl, "video"), "multi_modal_data": {"video": np.zeros((2, 28, 28, 3))}})
    # two placeholders with no separator would merge into one span
    pad = vl.placeholder_token("image")
    with pytest.raises(ValueError, match="image item 1: its placeholder directly follows the one of image item 0"):
        vl.process({"prompt": pad + pad, "multi_modal_data": {"image": [image(0), image(1)]}})


def test_resampled_audio(omni):
    tone = np.sin(2 * np.pi * 300 * np.arange(44100) / 44100).astype(np.float32)
    out = omni.process({"prompt": chat(omni, "audio"), "multi_modal_data": {"audio": (tone, 44100)}})
    (f,) = out.mm_features
    assert f.data["audio_feature_lengths"].tolist() == [100]  # 1 s at a 10 ms hop
    assert f.mm_position.length == 25


def test_audio_too_short_for_an_embedding_is_refused(omni):
    prompt = chat(omni, "text", "audio")
    # 320 samples: two 10 ms mel frames, which the audio tower's strides turn into no embedding
    with pytest.raises(ValueError, match=r"audio item 0: the clip is 20.0 ms long \(2 mel frame\(s\)\), too short"):
        omni.process({"prompt": prompt, "multi_modal_data": {"audio": (np.full(320, 0.1, np.float32), 16000)}})
    out = omni.process({"prompt": prompt, "multi_modal_data": {"audio": (np.full(321, 0.1, np.float32), 16000)}})
    assert [f.mm_position.length for f in out.mm_features] == [1]
    assert out.prompt_token_ids.count(omni.placeholder_ids["audio"]) == 1


def test_max_tokens_per_item(vl, omni):
    assert vl.max_tokens_per_item(max_video_frames=8) == {"image": 64, "video": 4 * 16}
    # Qwen2.5-Omni's video size is its processor's, not the checkpoint's: 768 merged tokens per frame pair
    assert omni.max_tokens_per_item(max_video_frames=8) == {"image": 64, "video": 4 * 768, "audio": 750}
