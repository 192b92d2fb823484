"""Content identifiers: equal content shares, different content never collides."""

from __future__ import annotations

import base64
import io

import numpy as np
import torch
from PIL import Image

from omnistage.multimodal.hashing import MultiModalHasher, hash_audio, hash_image, hash_item, hash_video
from omnistage.multimodal.media import load_image


def _image(seed: int = 0, size=(20, 30)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


def test_same_pixels_share_through_every_route(tmp_path):
    image = _image()
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    path = tmp_path / "a.png"
    path.write_bytes(buf.getvalue())
    data_url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    ids = {
        hash_image(image),
        hash_image(load_image(str(path))),
        hash_image(load_image(data_url)),
        hash_image(load_image(buf.getvalue())),
        hash_image(image.copy()),
    }
    assert len(ids) == 1
    assert len(next(iter(ids))) == 64  # SHA-256 hex


def test_different_pixels_mode_size_or_options_differ():
    image = _image()
    changed = np.asarray(image).copy()
    changed[0, 0, 0] ^= 1
    base = hash_image(image)
    assert hash_image(Image.fromarray(changed)) != base
    assert hash_image(image.convert("RGBA")) != base
    # same bytes, transposed shape
    flat = np.asarray(image).reshape(30, 20, 3)
    assert hash_image(Image.fromarray(np.ascontiguousarray(flat))) != base
    assert hash_image(image, {"max_pixels": 1000}) != base
    assert hash_image(image, {"max_pixels": 1000}) == hash_image(image, {"max_pixels": 1000})
    # key order of options does not matter
    assert hash_image(image, {"a": 1, "b": 2}) == hash_image(image, {"b": 2, "a": 1})


def test_a_transparent_colour_is_part_of_the_image():
    """Converted to RGB (as transformers' processors convert), a colour a PNG declares
    transparent turns white: the same pixels with and without one hash apart."""
    image = _image()
    pngs = [_png_bytes(image, **options) for options in ({}, {"transparency": (0, 0, 0)}, {"transparency": (1, 2, 3)})]
    assert len({hash_image(load_image(png)) for png in pngs}) == 3


def _png_bytes(image: Image.Image, **options) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG", **options)
    return buf.getvalue()


def test_video_dtype_shape_and_bytes():
    rng = np.random.default_rng(1)
    frames = rng.integers(0, 256, (4, 8, 8, 3), dtype=np.uint8)
    base = hash_video(frames)
    assert hash_video(frames.copy()) == base
    assert hash_video(torch.from_numpy(frames)) == base
    assert hash_video(frames.reshape(2, 16, 8, 3)) != base  # same bytes, other shape
    assert hash_video(frames.view(np.int8)) != base  # same bytes, other dtype
    assert hash_video(frames, {"fps": 2.0}) != hash_video(frames, {"fps": 4.0})


def test_audio_samples_and_rate():
    wave = np.linspace(-1, 1, 1000, dtype=np.float32)
    base = hash_audio(wave, 16000)
    assert hash_audio(wave.copy(), 16000) == base
    assert hash_audio(wave, 16000.0) == base
    assert hash_audio(wave, 8000) != base
    assert hash_audio(wave.astype(np.float64), 16000) != base
    assert hash_item("audio", (wave, 16000)) == base


def test_modalities_never_share():
    data = np.zeros((2, 2, 2, 3), dtype=np.uint8)
    assert hash_item("video", data) != hash_item("image", data) != hash_item("other", data)


def test_fields_are_length_prefixed():
    # "ab" + "c" and "a" + "bc" must not produce the same stream
    one, two = MultiModalHasher("x"), MultiModalHasher("x")
    one.add_bytes("f", b"ab")
    one.add_bytes("f", b"c")
    two.add_bytes("f", b"a")
    two.add_bytes("f", b"bc")
    assert one.hexdigest() != two.hexdigest()


def test_bfloat16_tensors_hash():
    t = torch.randn(3, 4).to(torch.bfloat16)
    hasher = MultiModalHasher("x")
    hasher.add_array("t", t)
    other = MultiModalHasher("x")
    other.add_array("t", t.float())
    assert hasher.hexdigest() != other.hexdigest()
