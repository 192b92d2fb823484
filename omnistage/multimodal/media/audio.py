"""Audio: ``(waveform, sample_rate)`` pairs and WAV files, resampled to the model's rate."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from omnistage.multimodal.media.source import OFFLINE, MediaError, MediaLimits, decode_base64, read_media_bytes
from omnistage.multimodal.media.wav import MAX_SAMPLE_RATE, DecodedAudio, decode_wav

__all__ = ["decode_input_audio", "load_audio", "resample_audio"]


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


def _waveform_pair(source: tuple[Any, Any] | list[Any], where: str) -> tuple[np.ndarray, int]:
    waveform, sr = source
    if isinstance(waveform, torch.Tensor):
        waveform = waveform.detach().cpu().numpy()
    if not isinstance(waveform, np.ndarray) or isinstance(sr, bool) or not isinstance(sr, (int, float, np.number)):
        raise MediaError(
            where,
            f"expected (waveform, sample_rate) with a NumPy array or tensor and a number, "
            f"got ({type(waveform).__name__}, {type(sr).__name__})",
            "invalid_audio",
        )
    if waveform.ndim != 1:
        raise MediaError(
            where,
            f"expected a mono waveform of shape (num_samples,), got shape {tuple(waveform.shape)}",
            "invalid_audio",
        )
    if not np.issubdtype(waveform.dtype, np.floating):
        raise MediaError(where, f"expected float samples in [-1, 1], got dtype {waveform.dtype}", "invalid_audio")
    if not 0 < sr <= MAX_SAMPLE_RATE or sr != int(sr):  # NaN fails the first test
        raise MediaError(
            where, f"expected an integer sample rate in 1..{MAX_SAMPLE_RATE} Hz, got {sr}", "invalid_audio"
        )
    return waveform, int(sr)


def load_audio(
    source: Any, target_sr: int, where: str = "audio item 0", limits: MediaLimits = OFFLINE
) -> tuple[np.ndarray, int]:
    """``(waveform float32 [N] at target_sr, original rate)`` from a
    ``(waveform, sample_rate)`` pair (1-D float samples) or a WAV file given as
    bytes, a data URL, a ``file://`` URL or a local path."""
    if isinstance(source, (str, bytes, bytearray, memoryview)):
        decoded = decode_wav(read_media_bytes(source, "audio", where, limits), where, limits)
        waveform, sr = decoded.samples, decoded.sample_rate
    elif isinstance(source, (tuple, list)) and len(source) == 2:
        waveform, sr = _waveform_pair(source, where)
    else:
        raise MediaError(
            where,
            f"expected a (waveform, sample_rate) pair, a local WAV path or a data URL, got {type(source).__name__}",
            "invalid_audio",
        )
    waveform = np.asarray(waveform, dtype=np.float32)
    if waveform.size == 0:
        raise MediaError(where, "the waveform is empty; expected at least one sample", "invalid_audio")
    if not np.isfinite(waveform).all():
        raise MediaError(where, "the waveform contains NaN or infinite samples", "invalid_audio")
    if limits.max_audio_seconds is not None and len(waveform) / sr > limits.max_audio_seconds:
        raise MediaError(
            where,
            f"audio is {len(waveform) / sr:.1f} s long, over the limit of {limits.max_audio_seconds:g} s",
            "audio_too_long",
        )
    return resample_audio(waveform, sr, target_sr), sr


def decode_input_audio(data: str, fmt: str, where: str, limits: MediaLimits = OFFLINE) -> DecodedAudio:
    """An OpenAI ``input_audio`` part (``{"data": base64, "format": fmt}``,
    named ``where``) at its own rate. Errors name ``where.format`` or ``where.data``."""
    if fmt != "wav":
        raise MediaError(
            f"{where}.format", f"audio format {fmt!r} cannot be decoded; send WAV", "unsupported_audio_format"
        )
    return decode_wav(decode_base64(data, f"{where}.data"), f"{where}.data", limits)
