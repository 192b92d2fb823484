"""Decoding of the images and audio clips that chat messages carry, with limits.

Policy:

- Images come as ``data:image/...;base64,`` URLs, or as ``file://`` URLs that
  resolve (symlinks followed) to a regular file under the directory given by
  ``--allowed-local-media-path``; paths holding ``..`` are refused outright.
  Remote ``http(s)://`` URLs are refused: this server never fetches from the
  network on a client's behalf (no SSRF, no unbounded waits).
- Audio comes as base64 WAV (``input_audio``); PCM 8/16/24/32-bit integer and
  32/64-bit float are decoded with a small RIFF reader (no codec dependency).
- Every limit is checked from the header before the payload is decoded, so an
  oversized image or clip costs a header parse, not a decode.

Every failure is an ``APIError`` (400) naming the offending part, so a broken
image gets its own message rather than a generic one.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import struct
import warnings
from dataclasses import dataclass
from urllib.parse import unquote, urlparse

import numpy as np
from PIL import Image, UnidentifiedImageError

from omnistage.entrypoints.openai.errors import APIError, bad_request


@dataclass(frozen=True)
class MediaLimits:
    """Bounds on what one content part may hold."""

    max_image_pixels: int = 4096 * 4096
    max_audio_seconds: float = 600.0
    max_media_bytes: int = 16 * 1024 * 1024  # for local files; request bodies are bounded separately
    allowed_local_media_path: str | None = None


@dataclass(frozen=True)
class DecodedAudio:
    samples: np.ndarray  # float32, mono, in [-1, 1]
    sample_rate: int

    @property
    def duration_s(self) -> float:
        return len(self.samples) / self.sample_rate


def _media_error(message: str, param: str, code: str) -> APIError:
    return bad_request(message, param=param, code=code)


def decode_base64(data: str, param: str) -> bytes:
    """Strict base64 (whitespace tolerated, since some clients wrap lines)."""
    compact = "".join(data.split())
    if not compact:
        raise _media_error(f"{param}: empty base64 payload", param, "invalid_base64")
    try:
        return base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise _media_error(f"{param}: invalid base64 data ({exc})", param, "invalid_base64") from None


def parse_data_url(url: str, param: str) -> tuple[str, bytes]:
    """Split ``data:<mime>;base64,<payload>`` into (mime, bytes)."""
    header, sep, payload = url[len("data:"):].partition(",")
    if not sep:
        raise _media_error(f"{param}: malformed data URL (no ',' separating header and data)", param, "invalid_data_url")
    fields = header.split(";")
    mime = fields[0].strip().lower()
    if "base64" not in (f.strip().lower() for f in fields[1:]):
        raise _media_error(f"{param}: data URLs must be base64-encoded (';base64,')", param, "invalid_data_url")
    return mime, decode_base64(payload, param)


def read_local_file(url: str, limits: MediaLimits, param: str) -> bytes:
    """Read a ``file://`` URL, only from under the allowed directory."""
    if limits.allowed_local_media_path is None:
        raise _media_error(
            f"{param}: local file URLs are disabled; start the server with --allowed-local-media-path to allow them",
            param,
            "local_media_disabled",
        )
    parsed = urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise _media_error(f"{param}: file URLs must name a local path, got host {parsed.netloc!r}", param, "invalid_url")
    raw_path = unquote(parsed.path)
    # Refuse '..' before resolving: even when the result would land inside the
    # allowed directory, a client sending '..' is probing, and the check below
    # would hide the intent from the logs.
    if ".." in raw_path.split("/"):
        raise _media_error(f"{param}: '..' is not allowed in local media paths", param, "path_not_allowed")
    root = os.path.realpath(limits.allowed_local_media_path)
    resolved = os.path.realpath(raw_path)  # follows symlinks: a link out of the root is caught here
    if os.path.commonpath([root, resolved]) != root:
        raise _media_error(f"{param}: {raw_path!r} is outside the allowed local media directory", param, "path_not_allowed")
    if not os.path.isfile(resolved):
        raise _media_error(f"{param}: no such file {raw_path!r}", param, "file_not_found")
    size = os.path.getsize(resolved)
    if size > limits.max_media_bytes:
        raise _media_error(
            f"{param}: file is {size} bytes, over the limit of {limits.max_media_bytes}", param, "media_too_large"
        )
    with open(resolved, "rb") as f:
        return f.read()


def fetch_image_bytes(url: str, limits: MediaLimits, param: str) -> bytes:
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        mime, data = parse_data_url(url, param)
        if not mime.startswith("image/"):
            raise _media_error(f"{param}: expected an image data URL, got media type {mime!r}", param, "invalid_media_type")
        return data
    if scheme == "file":
        return read_local_file(url, limits, param)
    if scheme in ("http", "https"):
        raise _media_error(
            f"{param}: remote image URLs are not fetched by this server; send the image as a base64 data URL",
            param,
            "remote_url_not_allowed",
        )
    raise _media_error(f"{param}: unsupported image URL scheme {scheme or url[:16]!r}", param, "invalid_url")


def decode_image(data: bytes, limits: MediaLimits, param: str) -> Image.Image:
    """Decode image bytes to RGB, checking the pixel count from the header first."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:
        raise _media_error(f"{param}: image exceeds the limit of {limits.max_image_pixels} pixels", param, "image_too_large") from None
    except UnidentifiedImageError:
        raise _media_error(f"{param}: could not decode image (not a recognized image format)", param, "invalid_image") from None
    except (OSError, ValueError) as exc:
        raise _media_error(f"{param}: could not decode image ({exc})", param, "invalid_image") from None
    width, height = img.size
    if width <= 0 or height <= 0:
        raise _media_error(f"{param}: image has no pixels ({width}x{height})", param, "invalid_image")
    if width * height > limits.max_image_pixels:
        raise _media_error(
            f"{param}: image is {width}x{height} = {width * height} pixels, over the limit of {limits.max_image_pixels}",
            param,
            "image_too_large",
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img.load()  # a truncated file fails here, not later inside a model processor
            return img.convert("RGB")
    except (OSError, ValueError, SyntaxError) as exc:
        raise _media_error(f"{param}: could not decode image ({exc})", param, "invalid_image") from None


def load_image(url: str, limits: MediaLimits, param: str) -> Image.Image:
    return decode_image(fetch_image_bytes(url, limits, param), limits, param)


# --------------------------------------------------------------------------- audio

_WAVE_FORMAT_PCM = 1
_WAVE_FORMAT_FLOAT = 3
_WAVE_FORMAT_EXTENSIBLE = 0xFFFE


def _parse_wav_header(data: bytes, param: str) -> tuple[int, int, int, int, memoryview]:
    """Return (format_tag, channels, sample_rate, bits, payload) of a RIFF/WAVE file."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise _media_error(f"{param}: audio data is not a WAV (RIFF/WAVE) file", param, "invalid_audio")
    view = memoryview(data)
    pos = 12
    fmt: tuple[int, int, int, int] | None = None
    while pos + 8 <= len(data):
        chunk_id = bytes(view[pos:pos + 4])
        (size,) = struct.unpack_from("<I", data, pos + 4)
        body_start = pos + 8
        body_end = min(body_start + size, len(data))  # streamed WAVs may claim 0xFFFFFFFF
        if chunk_id == b"fmt ":
            if body_end - body_start < 16:
                raise _media_error(f"{param}: WAV 'fmt ' chunk is truncated", param, "invalid_audio")
            tag, channels, rate, _byte_rate, _align, bits = struct.unpack_from("<HHIIHH", data, body_start)
            if tag == _WAVE_FORMAT_EXTENSIBLE and body_end - body_start >= 26:
                (tag,) = struct.unpack_from("<H", data, body_start + 24)  # first 2 bytes of the sub-format GUID
            fmt = (tag, channels, rate, bits)
        elif chunk_id == b"data":
            if fmt is None:
                raise _media_error(f"{param}: WAV 'data' chunk comes before 'fmt '", param, "invalid_audio")
            return (*fmt, view[body_start:body_end])
        pos = body_start + size + (size & 1)  # chunks are padded to even sizes
    raise _media_error(f"{param}: WAV file has no 'data' chunk", param, "invalid_audio")


def decode_wav(data: bytes, limits: MediaLimits, param: str) -> DecodedAudio:
    """Decode a WAV file to mono float32, checking the duration before converting samples."""
    tag, channels, rate, bits, payload = _parse_wav_header(data, param)
    supported = {_WAVE_FORMAT_PCM: (8, 16, 24, 32), _WAVE_FORMAT_FLOAT: (32, 64)}
    if tag not in supported or bits not in supported[tag]:
        raise _media_error(
            f"{param}: unsupported WAV encoding (format tag {tag}, {bits} bits); use PCM 8/16/24/32-bit or float 32/64-bit",
            param,
            "invalid_audio",
        )
    if channels < 1 or not 1 <= rate <= 768_000:
        raise _media_error(f"{param}: invalid WAV header ({channels} channels, {rate} Hz)", param, "invalid_audio")
    frame_bytes = channels * bits // 8
    frames = len(payload) // frame_bytes
    if frames == 0:
        raise _media_error(f"{param}: audio has no samples", param, "invalid_audio")
    duration = frames / rate
    if duration > limits.max_audio_seconds:
        raise _media_error(
            f"{param}: audio is {duration:.1f} s long, over the limit of {limits.max_audio_seconds:g} s",
            param,
            "audio_too_long",
        )
    raw = np.frombuffer(payload[: frames * frame_bytes], dtype=np.uint8)
    if tag == _WAVE_FORMAT_FLOAT:
        samples = raw.view("<f4" if bits == 32 else "<f8").astype(np.float32)
    elif bits == 8:
        samples = (raw.astype(np.float32) - 128.0) / 128.0  # 8-bit WAV is unsigned
    elif bits == 24:
        triples = raw.reshape(-1, 3).astype(np.int32)
        ints = triples[:, 0] | (triples[:, 1] << 8) | (triples[:, 2] << 16)
        ints = np.where(ints >= 1 << 23, ints - (1 << 24), ints)
        samples = ints.astype(np.float32) / float(1 << 23)
    else:
        samples = raw.view("<i2" if bits == 16 else "<i4").astype(np.float32) / float(1 << (bits - 1))
    samples = samples.reshape(frames, channels).mean(axis=1, dtype=np.float32)
    if not np.all(np.isfinite(samples)):
        raise _media_error(f"{param}: audio holds NaN or infinite samples", param, "invalid_audio")
    return DecodedAudio(samples=np.ascontiguousarray(samples), sample_rate=rate)


def decode_audio(data_b64: str, fmt: str, limits: MediaLimits, param: str) -> DecodedAudio:
    raw = decode_base64(data_b64, f"{param}.data")
    if fmt != "wav":
        raise _media_error(
            f"{param}.format: audio format {fmt!r} cannot be decoded by this server; send WAV",
            f"{param}.format",
            "unsupported_audio_format",
        )
    return decode_wav(raw, limits, f"{param}.data")
