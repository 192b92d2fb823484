"""Media decoding and its errors."""

from __future__ import annotations

import base64
import io
import wave

import numpy as np
import pytest
import torch
from PIL import Image

from omnistage.multimodal.media import load_audio, load_image, load_video, resample_audio


def _png_bytes(size=(10, 12)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (10, 20, 30)).save(buf, format="PNG")
    return buf.getvalue()


def test_load_image_sources(tmp_path):
    data = _png_bytes()
    path = tmp_path / "x.png"
    path.write_bytes(data)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    for source in (data, str(path), f"file://{path}", url, Image.open(io.BytesIO(data))):
        image = load_image(source)
        assert image.size == (10, 12)
    array = np.zeros((5, 6, 3), dtype=np.uint8)
    assert load_image(array).size == (6, 5)


@pytest.mark.parametrize(
    "source, match",
    [
        (b"not an image", "image item 3: could not decode"),
        ("data:image/png;base64,%%%", "image item 3: the data URL's base64 payload"),
        ("/no/such/file.png", "image item 3: '/no/such/file.png' is not a readable file"),
        ("https://example.com/a.png", "image item 3: remote URLs are not fetched"),
        (np.zeros((4, 4), dtype=np.float32), "image item 3: expected a uint8 array"),
        (42, "image item 3: expected a PIL image"),
    ],
)
def test_load_image_errors(source, match):
    with pytest.raises(ValueError, match=match):
        load_image(source, "image item 3")


def test_truncated_png_is_a_value_error():
    with pytest.raises(ValueError, match="image item 0: could not decode"):
        load_image(_png_bytes()[:40])


def test_load_audio_pairs_and_errors():
    wave_ = np.sin(np.arange(16000) / 10).astype(np.float32)
    out, sr = load_audio((wave_, 16000), 16000)
    assert sr == 16000 and out is not None and np.array_equal(out, wave_)
    out, _ = load_audio((torch.from_numpy(wave_), 16000), 16000)
    assert np.array_equal(out, wave_)
    mono = r"audio item 1: expected a mono waveform of shape \(num_samples,\), got shape \(2, 8000\)"
    with pytest.raises(ValueError, match=mono):
        load_audio((wave_.reshape(2, 8000), 16000), 16000, "audio item 1")
    with pytest.raises(ValueError, match="audio item 0: expected float samples"):
        load_audio((np.zeros(10, dtype=np.int16), 16000), 16000)
    with pytest.raises(ValueError, match="audio item 0: the waveform is empty"):
        load_audio((np.zeros(0, dtype=np.float32), 16000), 16000)
    with pytest.raises(ValueError, match="audio item 0: expected a positive integer sample rate"):
        load_audio((wave_, 0), 16000)
    with pytest.raises(ValueError, match=r"audio item 0: expected a \(waveform, sample_rate\) pair"):
        load_audio(wave_, 16000)
    with pytest.raises(ValueError, match="NaN"):
        load_audio((np.array([0.0, np.nan], dtype=np.float32), 16000), 16000)


def test_load_wav_file(tmp_path):
    samples = (np.sin(np.arange(8000) / 5) * 20000).astype("<i2")
    path = tmp_path / "a.wav"
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(8000)
        f.writeframes(samples.tobytes())
    out, sr = load_audio(str(path), 16000)
    assert sr == 8000 and len(out) == 16000
    with pytest.raises(ValueError, match="audio item 0: could not decode the audio data as PCM WAV"):
        load_audio(b"RIFF....garbage", 16000)


@pytest.mark.parametrize("orig, target", [(44100, 16000), (48000, 16000), (8000, 16000), (22050, 16000)])
def test_resample_keeps_a_tone(orig, target):
    t = np.arange(orig) / orig
    tone = np.sin(2 * np.pi * 440 * t).astype(np.float32)
    out = resample_audio(tone, orig, target)
    assert len(out) == target
    expected = np.sin(2 * np.pi * 440 * np.arange(target) / target)
    assert np.abs(out[100:-100] - expected[100:-100]).max() < 1e-3


def _direct_resample(x: np.ndarray, orig: int, target: int, zeros: int = 16) -> np.ndarray:
    """The documented formula, one output sample at a time."""
    import math

    cutoff = min(1.0, target / orig)
    half = math.ceil(zeros / cutoff)
    out = np.zeros(-(-len(x) * target // orig))
    for n in range(len(out)):
        t = n * orig / target
        k = np.arange(math.floor(t) - half + 1, math.floor(t) + half + 1)
        d = k - t
        h = cutoff * np.sinc(cutoff * d) * (0.5 + 0.5 * np.cos(np.pi * np.clip(d, -half, half) / half))
        valid = (k >= 0) & (k < len(x))
        out[n] = (x[k[valid]] * h[valid]).sum()
    return out


@pytest.mark.parametrize("orig, target", [(22050, 16000), (16001, 16000), (8000, 16000)])
def test_resample_matches_the_formula(orig, target):
    # 16001 -> 16000 has 16000 phases and takes the per-sample path
    x = np.random.default_rng(0).standard_normal(1500).astype(np.float32)
    out = resample_audio(x, orig, target)
    np.testing.assert_allclose(out, _direct_resample(x, orig, target), atol=2e-5)
    assert resample_audio(x, 16000, 16000) is x


def test_load_video_forms_and_errors():
    frames = np.zeros((3, 8, 10, 3), dtype=np.uint8)
    assert load_video(frames).frames.shape == (3, 8, 10, 3)
    assert load_video(torch.from_numpy(frames)).frames.shape == (3, 8, 10, 3)
    grey = load_video(np.zeros((2, 8, 10), dtype=np.uint8))
    assert grey.frames.shape == (2, 8, 10, 3)
    listed = load_video(([Image.new("RGB", (10, 8))] * 2, {"fps": 4}))
    assert listed.frames.shape == (2, 8, 10, 3) and listed.metadata == {"fps": 4}
    with pytest.raises(ValueError, match="video item 2: expected uint8 frames, got dtype float32"):
        load_video(frames.astype(np.float32), "video item 2")
    with pytest.raises(ValueError, match=r"video item 0: expected frames of shape \[T, H, W, 3\]"):
        load_video(np.zeros((2, 3, 8, 10, 3), dtype=np.uint8))
    with pytest.raises(ValueError, match="video item 0: frames differ in size"):
        load_video([Image.new("RGB", (10, 8)), Image.new("RGB", (8, 8))])
    with pytest.raises(ValueError, match="video item 0: metadata fps must be a positive number"):
        load_video((frames, {"fps": 0}))
    with pytest.raises(ValueError, match="video item 0: the video is empty"):
        load_video(np.zeros((0, 8, 10, 3), dtype=np.uint8))
