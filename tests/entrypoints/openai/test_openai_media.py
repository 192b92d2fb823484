"""The server's media adapter: the server's bounds, and every media failure a
400 naming the part and the problem. (Decoding itself is tested with the one
media module, tests/multimodal/test_media.py and test_media_wav.py.)"""

from __future__ import annotations

import base64

import numpy as np
import pytest

from omnistage.entrypoints.openai.errors import APIError
from omnistage.entrypoints.openai.media import (
    DEFAULT_MAX_AUDIO_SECONDS,
    DEFAULT_MAX_IMAGE_PIXELS,
    decode_audio,
    load_image,
    server_media_limits,
)

from oai_helpers import png_bytes, png_data_url, wav_bytes

P = "messages[0].content[1].image_url.url"
A = "messages[0].content[0].input_audio"


def _err(fn, *args) -> APIError:
    with pytest.raises(APIError) as info:
        fn(*args)
    assert info.value.status_code == 400
    return info.value


def test_data_url_image_decodes_to_rgb() -> None:
    img = load_image(png_data_url(8, 6), server_media_limits(), P)
    assert img.size == (8, 6) and img.mode == "RGB"


@pytest.mark.parametrize(
    "url, code, words",
    [
        ("data:image/png;base64,@@@notbase64@@@", "invalid_base64", "invalid base64"),
        ("data:image/png," + base64.b64encode(b"x").decode(), "invalid_data_url", "base64"),
        ("data:text/plain;base64," + base64.b64encode(b"hello").decode(), "invalid_media_type", "text/plain"),
        ("data:image/png;base64," + base64.b64encode(png_bytes(64, 64)[:60]).decode(), "invalid_image", "could not decode"),
        ("https://example.com/cat.png", "remote_url_not_allowed", "remote"),
        ("ftp://x/y.png", "invalid_url", "scheme"),
        ("file:///etc/passwd", "local_media_disabled", "allowed-local-media-path"),
        ("/etc/passwd", "local_media_disabled", "allowed-local-media-path"),
    ],
)
def test_bad_images_are_400s_naming_the_field(url: str, code: str, words: str) -> None:
    err = _err(load_image, url, server_media_limits(), P)
    assert err.code == code and err.param == P
    assert words in err.message and err.message.startswith(f"{P}: ")


def test_server_bounds() -> None:
    limits = server_media_limits()
    assert limits.max_image_pixels == DEFAULT_MAX_IMAGE_PIXELS and limits.max_audio_seconds == DEFAULT_MAX_AUDIO_SECONDS
    assert not limits.local_files and limits.max_media_bytes is not None
    err = _err(load_image, png_data_url(100, 50), server_media_limits(max_image_pixels=4999), P)
    assert err.code == "image_too_large" and "100x50" in err.message


def test_local_files_only_under_the_allowed_directory(tmp_path) -> None:
    root = tmp_path / "media"
    root.mkdir()
    (root / "ok.png").write_bytes(png_bytes(4, 4))
    (tmp_path / "secret.png").write_bytes(png_bytes(4, 4))
    limits = server_media_limits(allowed_local_media_path=str(root))
    assert load_image(f"file://{root}/ok.png", limits, P).size == (4, 4)
    assert _err(load_image, f"file://{root}/../secret.png", limits, P).code == "path_not_allowed"
    assert _err(load_image, f"file://{tmp_path}/secret.png", limits, P).code == "path_not_allowed"
    small = server_media_limits(allowed_local_media_path=str(root), max_media_bytes=10)
    assert _err(load_image, f"file://{root}/ok.png", small, P).code == "media_too_large"


@pytest.mark.parametrize("bits, float_format", [(8, False), (16, False), (24, False), (32, False), (32, True), (64, True)])
def test_wav_encodings_roundtrip(bits: int, float_format: bool) -> None:
    t = np.arange(800) / 8000
    x = 0.5 * np.sin(2 * np.pi * 200 * t)
    data = base64.b64encode(wav_bytes(x, 8000, bits, float_format)).decode()
    audio = decode_audio(data, "wav", server_media_limits(), A)
    assert audio.sample_rate == 8000 and audio.samples.dtype == np.float32
    tol = 2e-2 if bits == 8 else 1e-3
    np.testing.assert_allclose(audio.samples, x, atol=tol)


def test_stereo_mixed_to_mono() -> None:
    x = np.stack([np.full(100, 0.5), np.full(100, -0.1)], axis=1)
    data = base64.b64encode(wav_bytes(x, 16000, 16, channels=2)).decode()
    np.testing.assert_allclose(decode_audio(data, "wav", server_media_limits(), A).samples, 0.2, atol=1e-3)


def test_bad_audio() -> None:
    limits = server_media_limits(max_audio_seconds=1.0)
    long_wav = base64.b64encode(wav_bytes(np.zeros(16000 * 2), 16000)).decode()
    err = _err(decode_audio, long_wav, "wav", limits, A)
    assert err.code == "audio_too_long" and "2.0 s" in err.message and err.param == f"{A}.data"
    assert _err(decode_audio, "%%%", "wav", limits, A).code == "invalid_base64"
    assert _err(decode_audio, base64.b64encode(b"RIFF....nope").decode(), "wav", limits, A).code == "invalid_audio"
    empty = base64.b64encode(wav_bytes(np.zeros(0), 16000)).decode()
    assert "no samples" in _err(decode_audio, empty, "wav", limits, A).message
    mp3 = _err(decode_audio, base64.b64encode(b"ID3....").decode(), "mp3", limits, A)
    assert mp3.code == "unsupported_audio_format" and mp3.param == f"{A}.format"
