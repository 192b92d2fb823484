"""Media decoding, sources and limits, and their errors (WAV files: test_media_wav.py).

The server's checks (data URLs, allowed local directory, header-checked
bounds) live here too: one module decodes for the offline API and the server."""

from __future__ import annotations

import base64
import io
import os
import wave

import numpy as np
import pytest
import torch
from PIL import Image

from omnistage.multimodal.media import MediaError, MediaLimits, load_audio, load_image, load_video, resample_audio


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
        ("data:image/png;base64,%%%", "image item 3: invalid base64 data"),
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
    for rate in (0, 16000.5, float("nan"), 10**10):  # a huge rate would build a resampler as large
        with pytest.raises(ValueError, match=r"audio item 0: expected an integer sample rate in 1\.\.768000 Hz"):
            load_audio((wave_, rate), 16000)
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
    with pytest.raises(ValueError, match=r"audio item 0: audio data is not a WAV \(RIFF/WAVE\) file"):
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
    for fps in (0, float("nan"), float("inf")):  # NaN would reach the M-RoPE time positions
        with pytest.raises(ValueError, match="video item 0: metadata fps must be a positive finite number"):
            load_video((frames, {"fps": fps}))
    with pytest.raises(ValueError, match="video item 0: the video is empty"):
        load_video(np.zeros((0, 8, 10, 3), dtype=np.uint8))


def test_video_frames_bounded_by_max_image_pixels():
    frames = np.zeros((2, 8, 10, 3), dtype=np.uint8)
    assert load_video(frames, limits=MediaLimits(max_image_pixels=80)).frames.shape == (2, 8, 10, 3)
    with pytest.raises(MediaError, match="video item 0: frames are 10x8 = 80 pixels, over the limit of 79") as info:
        load_video(frames, limits=MediaLimits(max_image_pixels=79))
    assert info.value.code == "image_too_large"
    with pytest.raises(MediaError, match="video item 1 frame 0: image is 10x8") as info:
        load_video([Image.new("RGB", (10, 8))], "video item 1", MediaLimits(max_image_pixels=79))


# ----------------------------------------------------------- sources, limits (ported from the server's media tests)

P = "messages[0].content[1].image_url.url"
SERVER_LIKE = MediaLimits(max_image_pixels=4096 * 4096, max_audio_seconds=600, max_media_bytes=1 << 24, local_files=False)


def _media_error(fn, *args, **kwargs) -> MediaError:
    with pytest.raises(MediaError) as info:
        fn(*args, **kwargs)
    assert isinstance(info.value, ValueError)  # the offline API's contract: every failure is a ValueError
    return info.value


@pytest.mark.parametrize(
    "url, code, words",
    [
        ("data:image/png;base64,@@@notbase64@@@", "invalid_base64", "invalid base64"),
        ("data:image/png;base64,", "invalid_base64", "empty"),
        ("data:image/png," + base64.b64encode(b"x").decode(), "invalid_data_url", "base64"),
        ("data:image/png;base64" + "AAAA", "invalid_data_url", "separat"),
        ("data:text/plain;base64," + base64.b64encode(b"hello").decode(), "invalid_media_type", "text/plain"),
        ("data:image/png;base64," + base64.b64encode(b"not an image at all").decode(), "invalid_image", "could not decode image"),
        ("data:image/png;base64," + base64.b64encode(_png_bytes((64, 64))[:60]).decode(), "invalid_image", "could not decode image"),
        ("https://example.com/cat.png", "remote_url_not_allowed", "remote"),
        ("HTTP://127.0.0.1/cat.png", "remote_url_not_allowed", "remote"),
        ("ftp://x/y.png", "invalid_url", "scheme"),
        ("file:///etc/passwd", "local_media_disabled", "allowed-local-media-path"),
        ("/etc/passwd", "local_media_disabled", "allowed-local-media-path"),
    ],
)
def test_bad_image_sources_name_the_item_and_the_problem(url, code, words):
    err = _media_error(load_image, url, P, SERVER_LIKE)
    assert err.code == code and err.where == P
    assert words in str(err) and str(err).startswith(f"{P}: ")


def test_data_url_whitespace_and_media_type():
    url = "data:image/PNG;charset=x;base64," + "\n".join(base64.b64encode(_png_bytes()).decode())  # wrapped lines
    assert load_image(url).size == (10, 12)
    wav_in_image = "data:audio/wav;base64," + base64.b64encode(_png_bytes()).decode()
    assert "expected an image data URL" in str(_media_error(load_image, wav_in_image))


def test_pixel_limit_checked_from_header(monkeypatch):
    png = _png_bytes((100, 50))
    err = _media_error(load_image, png, P, MediaLimits(max_image_pixels=4999))
    assert err.code == "image_too_large" and "100x50 = 5000 pixels, over the limit of 4999" in str(err)
    assert load_image(png, P, MediaLimits(max_image_pixels=5000)).size == (100, 50)
    # from the header: the pixels are never decoded
    monkeypatch.setattr(Image.Image, "load", lambda self: pytest.fail("decoded an oversized image"))
    _media_error(load_image, png, P, MediaLimits(max_image_pixels=4999))
    assert _media_error(load_image, np.zeros((50, 100), np.uint8), P, MediaLimits(max_image_pixels=10)).code == (
        "image_too_large"
    )


def test_decompression_bomb_is_a_media_error(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # PIL refuses above twice this
    err = _media_error(load_image, _png_bytes((20, 20)))
    assert err.code == "image_too_large" and err.where == "image item 0"


def test_allowed_local_media_path(tmp_path):
    root = tmp_path / "media"
    root.mkdir()
    (root / "ok.png").write_bytes(_png_bytes((4, 4)))
    outside = tmp_path / "secret.png"
    outside.write_bytes(_png_bytes((4, 4)))
    os.symlink(outside, root / "link.png")
    limits = MediaLimits(allowed_local_media_path=str(root))
    assert load_image(f"file://{root}/ok.png", P, limits).size == (4, 4)
    assert load_image(str(root / "ok.png"), P, limits).size == (4, 4)
    assert _media_error(load_image, f"file://{root}/../secret.png", P, limits).code == "path_not_allowed"
    assert _media_error(load_image, f"{root}/../media/ok.png", P, limits).code == "path_not_allowed"
    assert _media_error(load_image, f"file://{outside}", P, limits).code == "path_not_allowed"
    assert _media_error(load_image, f"file://{root}/link.png", P, limits).code == "path_not_allowed"  # symlink out
    assert _media_error(load_image, f"file://{root}/missing.png", P, limits).code == "file_not_found"
    assert _media_error(load_image, f"file://evil.host{root}/ok.png", P, limits).code == "invalid_url"
    small = MediaLimits(allowed_local_media_path=str(root), max_media_bytes=10)
    assert _media_error(load_image, f"file://{root}/ok.png", P, small).code == "media_too_large"
    # the offline default reads any path, '..' included
    assert load_image(f"{root}/../secret.png").size == (4, 4)


def test_audio_pair_bounded_by_max_audio_seconds():
    pair = (np.zeros(16001, dtype=np.float32), 16000)
    err = _media_error(load_audio, pair, 16000, "audio item 2", MediaLimits(max_audio_seconds=1.0))
    assert err.code == "audio_too_long" and "audio item 2: audio is 1.0 s long, over the limit of 1 s" in str(err)
    assert len(load_audio(pair, 16000)[0]) == 16001  # no bound by default
