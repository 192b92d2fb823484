"""WAV encoding of waveforms (temporary home; the media module takes it)."""

from __future__ import annotations

import io
import wave
from pathlib import Path

import numpy as np


def write_wav(path: str | Path, audio: np.ndarray, sample_rate: int) -> Path:
    """Write a float waveform in [-1, 1] as 16-bit PCM mono WAV (for the CLI)."""
    path = Path(path)
    path.write_bytes(encode_wav(audio, sample_rate))
    return path


def encode_wav(audio: np.ndarray, sample_rate: int) -> bytes:
    """A float waveform in [-1, 1] as the bytes of a 16-bit PCM mono WAV file
    (samples clipped, scaled by 32767 and rounded)."""
    pcm = (np.clip(np.asarray(audio, dtype=np.float32), -1.0, 1.0) * 32767.0).round().astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(int(sample_rate))
        f.writeframes(pcm.tobytes())
    return buf.getvalue()
