"""Decoding of user-supplied media into the arrays the processors take.

- images: a PIL image, a ``data:image/...;base64,`` URL, a local path or
  ``file://`` URL, raw encoded bytes, or an ``[H, W, C]`` uint8 array;
- audio: a ``(waveform, sample_rate)`` pair with a 1-D float waveform, or a
  local path / data URL of a PCM WAV file; resampled to the model's rate;
- video: an ``[T, H, W, C]`` (or ``[T, H, W]`` grey) uint8 frames array or
  tensor, or a list of images (frames), optionally paired with metadata as
  ``(frames, {"fps": 2.0})``. No container decoding: there is no video codec
  library in the environment.

Remote ``http(s)://`` URLs are refused: the engine runs offline; fetch first.
Every failure is a ``ValueError`` naming the item (``image item 2``) and what
was expected.
"""

from __future__ import annotations

import base64
import io
import math
import os
import wave
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

__all__ = ["DecodedVideo", "load_audio", "load_image", "load_video", "resample_audio"]


def _read_source(where: str, source: str | bytes, kind: str) -> bytes:
    """Bytes of a data URL, local path, ``file://`` URL or raw bytes."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source)
    if source.startswith("data:"):
        header, sep, payload = source.partition(",")
        if not sep:
            raise ValueError(
                f"{where}: malformed data URL (no ',' after the header); expected data:{kind}/...;base64,..."
            )
        try:
            if header.endswith(";base64"):
                return base64.b64decode(payload, validate=True)
            from urllib.parse import unquote_to_bytes

            return unquote_to_bytes(payload)
        except (ValueError, base64.binascii.Error) as exc:
            raise ValueError(f"{where}: the data URL's base64 payload does not decode: {exc}") from None
    if source.startswith(("http://", "https://")):
        raise ValueError(
            f"{where}: remote URLs are not fetched (the engine runs offline); "
            "download the file and pass a local path, bytes or a data URL"
        )
    path = source[len("file://") :] if source.startswith("file://") else source
    if not os.path.isfile(path):
        raise ValueError(f"{where}: {path!r} is not a readable file; expected a local path, a data URL or bytes")
    with open(path, "rb") as f:
        return f.read()


# ------------------------------------------------------------------- images


def load_image(source: Any, where: str = "image item 0") -> Image.Image:
    """Decode ``source`` to a fully loaded PIL image."""
    if isinstance(source, Image.Image):
        image = source
    elif isinstance(source, (np.ndarray, torch.Tensor)):
        array = source.detach().cpu().numpy() if isinstance(source, torch.Tensor) else source
        if array.dtype != np.uint8 or array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[2] not in (1, 3, 4)):
            raise ValueError(
                f"{where}: expected a uint8 array of shape [H, W] or [H, W, C] with C in (1, 3, 4), "
                f"got {array.dtype} {tuple(array.shape)}"
            )
        image = Image.fromarray(array[..., 0] if array.ndim == 3 and array.shape[2] == 1 else array)
    elif isinstance(source, (str, bytes, bytearray, memoryview)):
        data = _read_source(where, source, "image")
        try:
            image = Image.open(io.BytesIO(data))
            image.load()
        except (UnidentifiedImageError, OSError, SyntaxError) as exc:
            raise ValueError(f"{where}: could not decode the image data ({len(data)} bytes): {exc}") from None
    else:
        raise ValueError(
            f"{where}: expected a PIL image, a data URL, a local path, bytes or a uint8 array, "
            f"got {type(source).__name__}"
        )
    try:
        image.load()
    except OSError as exc:  # a truncated file opened lazily
        raise ValueError(f"{where}: could not decode the image data: {exc}") from None
    if image.width == 0 or image.height == 0:
        raise ValueError(f"{where}: the image is empty ({image.width}x{image.height})")
    return image


# -------------------------------------------------------------------- audio


def _sinc_kernel(dist: torch.Tensor, cutoff: float, half: int) -> torch.Tensor:
    window = 0.5 + 0.5 * torch.cos(math.pi * dist.clamp(-half, half) / half)
    return cutoff * torch.sinc(cutoff * dist) * window


def resample_audio(waveform: np.ndarray, orig_sr: int, target_sr: int, zeros: int = 16) -> np.ndarray:
    """Band-limited resampling with a Hann-windowed sinc kernel.

    Output sample ``n`` sits at input time ``t = n * orig_sr / target_sr``
    and is ``sum_k x[k] * h(k - t)`` over the ``2 * half`` nearest inputs
    ``k``, with ``h(d) = c * sinc(c * d) * hann(d / half)``, the cut-off
    ``c`` at the lower of the two Nyquist rates and ``half = ceil(zeros / c)``.
    With ``up / down`` the reduced rate ratio, output phases repeat every
    ``up`` samples, so one strided convolution per phase computes them all.
    Identity when the rates are equal.
    """
    if orig_sr == target_sr:
        return waveform
    gcd = math.gcd(int(orig_sr), int(target_sr))
    up, down = int(target_sr) // gcd, int(orig_sr) // gcd
    cutoff = min(1.0, up / down)
    half = int(math.ceil(zeros / cutoff))
    num_out = -(-len(waveform) * up // down)
    num_blocks = -(-num_out // up)
    taps = torch.arange(-half + 1, half + 1, dtype=torch.int64)
    phase = torch.arange(up, dtype=torch.int64)
    base = phase * down // up  # input position of phase p's first output, within its block
    dist = taps[None, :].to(torch.float64) - ((phase * down % up).to(torch.float64) / up)[:, None]
    kernel = _sinc_kernel(dist, cutoff, half)  # [up, 2*half]
    width = down + 2 * half
    if up * width > (1 << 24):  # an awkward rate pair: per-sample evaluation, in chunks
        x = torch.nn.functional.pad(torch.from_numpy(np.asarray(waveform, dtype=np.float64)), (half, half + 1))
        out = torch.empty(num_out, dtype=torch.float64)
        chunk = max(1, (1 << 21) // (2 * half))
        for lo in range(0, num_out, chunk):
            n = torch.arange(lo, min(lo + chunk, num_out), dtype=torch.int64)
            k = (n * down // up)[:, None] + taps[None, :]
            d = taps[None, :].to(torch.float64) - ((n * down % up).to(torch.float64) / up)[:, None]
            out[lo : lo + len(n)] = (x[k + half] * _sinc_kernel(d, cutoff, half)).sum(dim=1)
        return out.to(torch.float32).numpy()
    # phase p reads padded[b * down + base[p] + 1 + j] for j < 2*half (padded[i] = x[i - half])
    full = torch.zeros(up, width, dtype=torch.float64)
    cols = base[:, None] + torch.arange(2 * half)[None, :]
    full.scatter_(1, cols, kernel)
    x = torch.from_numpy(np.asarray(waveform, dtype=np.float32))
    right = max(0, (num_blocks - 1) * down + width - (len(x) + half - 1))
    padded = torch.nn.functional.pad(x, (half - 1, right))
    y = torch.nn.functional.conv1d(padded[None, None], full[:, None, :].float(), stride=down)  # [1, up, blocks]
    return y[0, :, :num_blocks].T.reshape(-1)[:num_out].contiguous().numpy()


def _decode_wav(where: str, data: bytes) -> tuple[np.ndarray, int]:
    try:
        with wave.open(io.BytesIO(data), "rb") as f:
            channels, width, rate = f.getnchannels(), f.getsampwidth(), f.getframerate()
            frames = f.readframes(f.getnframes())
    except (wave.Error, EOFError) as exc:
        raise ValueError(f"{where}: could not decode the audio data as PCM WAV: {exc}") from None
    if width == 1:
        samples = (np.frombuffer(frames, np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width == 2:
        samples = np.frombuffer(frames, "<i2").astype(np.float32) / 32768.0
    elif width == 4:
        samples = np.frombuffer(frames, "<i4").astype(np.float32) / 2147483648.0
    else:
        raise ValueError(f"{where}: unsupported WAV sample width {width} bytes; expected 1, 2 or 4")
    if channels > 1:  # a file's channels are mixed down; arrays must be mono already
        samples = samples.reshape(-1, channels).mean(axis=1)
    return samples, rate


def load_audio(source: Any, target_sr: int, where: str = "audio item 0") -> tuple[np.ndarray, int]:
    """Decode ``source`` and return ``(waveform float32 [N] at target_sr, original_sr)``."""
    if isinstance(source, (str, bytes, bytearray, memoryview)):
        waveform, sr = _decode_wav(where, _read_source(where, source, "audio"))
    elif isinstance(source, (tuple, list)) and len(source) == 2:
        waveform, sr = source
        if isinstance(waveform, torch.Tensor):
            waveform = waveform.detach().cpu().numpy()
        if not isinstance(waveform, np.ndarray) or isinstance(sr, bool) or not isinstance(sr, (int, float, np.number)):
            raise ValueError(
                f"{where}: expected (waveform, sample_rate) with a NumPy array or tensor and a number, "
                f"got ({type(waveform).__name__}, {type(sr).__name__})"
            )
        if waveform.ndim != 1:
            raise ValueError(
                f"{where}: expected a mono waveform of shape (num_samples,), got shape {tuple(waveform.shape)}"
            )
        if not np.issubdtype(waveform.dtype, np.floating):
            raise ValueError(f"{where}: expected float samples in [-1, 1], got dtype {waveform.dtype}")
        if sr <= 0 or sr != int(sr):
            raise ValueError(f"{where}: expected a positive integer sample rate, got {sr}")
        sr = int(sr)
    else:
        raise ValueError(
            f"{where}: expected a (waveform, sample_rate) pair, a local WAV path or a data URL, "
            f"got {type(source).__name__}"
        )
    waveform = np.asarray(waveform, dtype=np.float32)
    if waveform.size == 0:
        raise ValueError(f"{where}: the waveform is empty; expected at least one sample")
    if not np.isfinite(waveform).all():
        raise ValueError(f"{where}: the waveform contains NaN or infinite samples")
    return resample_audio(waveform, sr, target_sr), sr


# -------------------------------------------------------------------- video


@dataclass
class DecodedVideo:
    frames: np.ndarray  # uint8 [T, H, W, 3]
    metadata: dict[str, Any] = field(default_factory=dict)  # e.g. {"fps": 2.0}


def load_video(source: Any, where: str = "video item 0") -> DecodedVideo:
    """Frames as a uint8 ``[T, H, W, 3]`` array (grey frames are replicated
    to RGB, as transformers' video processor does), plus metadata."""
    metadata: dict[str, Any] = {}
    if isinstance(source, tuple) and len(source) == 2 and isinstance(source[1], Mapping):
        source, metadata = source[0], dict(source[1])
    if isinstance(source, (list, tuple)):
        if not source:
            raise ValueError(f"{where}: the frame list is empty; expected at least one frame")
        frames = [np.asarray(load_image(f, f"{where} frame {k}").convert("RGB")) for k, f in enumerate(source)]
        if len({f.shape for f in frames}) != 1:
            sizes = sorted({f.shape for f in frames})
            raise ValueError(f"{where}: frames differ in size ({sizes}); expected equal sizes")
        array = np.stack(frames)
    elif isinstance(source, (np.ndarray, torch.Tensor)):
        array = source.detach().cpu().numpy() if isinstance(source, torch.Tensor) else source
        if array.dtype != np.uint8:
            raise ValueError(f"{where}: expected uint8 frames, got dtype {array.dtype}")
        if array.ndim == 3:
            array = array[..., None]
        if array.ndim != 4 or array.shape[-1] not in (1, 3):
            raise ValueError(
                f"{where}: expected frames of shape [T, H, W, 3] (or [T, H, W] grey), got {tuple(source.shape)}"
            )
        if array.shape[-1] == 1:
            array = np.repeat(array, 3, axis=-1)
    else:
        raise ValueError(
            f"{where}: expected a uint8 frames array [T, H, W, 3] or a list of frames "
            f"(optionally as (frames, metadata)), got {type(source).__name__}"
        )
    if 0 in array.shape:
        raise ValueError(f"{where}: the video is empty (shape {tuple(array.shape)})")
    fps = metadata.get("fps")
    if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or fps <= 0):
        raise ValueError(f"{where}: metadata fps must be a positive number, got {fps!r}")
    return DecodedVideo(np.ascontiguousarray(array), metadata)
