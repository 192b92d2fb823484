"""WAV files: a small RIFF reader for every common sample encoding, and the
16-bit writer the engine's spoken answers go out through.

Read: PCM 8-bit (unsigned), 16/24/32-bit (signed) and IEEE float 32/64-bit,
plain or ``WAVE_FORMAT_EXTENSIBLE``, any channel count. Integers are scaled by
``2 ** (bits - 1)`` (8-bit: ``(x - 128) / 128``), as libsndfile (soundfile,
librosa) reads them, and channels are averaged to mono, as
``librosa.to_mono`` (and so transformers' ``load_audio``) does. No codec
library is needed, so nothing but WAV is read.
"""

from __future__ import annotations

import io
import struct
import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from omnistage.multimodal.media.source import OFFLINE, MediaError, MediaLimits

__all__ = ["DecodedAudio", "decode_wav", "encode_wav", "write_wav"]

_FORMAT_PCM = 1
_FORMAT_FLOAT = 3
_FORMAT_EXTENSIBLE = 0xFFFE
_SUPPORTED_BITS = {_FORMAT_PCM: (8, 16, 24, 32), _FORMAT_FLOAT: (32, 64)}
MAX_SAMPLE_RATE = 768_000


@dataclass(frozen=True)
class DecodedAudio:
    samples: np.ndarray  # float32 [N], mono; integer encodings land in [-1, 1)
    sample_rate: int

    @property
    def duration_s(self) -> float:
        return len(self.samples) / self.sample_rate


def _invalid(where: str, detail: str) -> MediaError:
    return MediaError(where, detail, "invalid_audio")


def _parse_header(data: bytes, where: str) -> tuple[int, int, int, int, memoryview]:
    """``(format tag, channels, sample rate, bits per sample, data chunk)`` of a RIFF/WAVE file."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise _invalid(where, "audio data is not a WAV (RIFF/WAVE) file; expected PCM or float WAV")
    view = memoryview(data)
    pos = 12
    fmt: tuple[int, int, int, int] | None = None
    while pos + 8 <= len(data):
        chunk_id = bytes(view[pos : pos + 4])
        (size,) = struct.unpack_from("<I", data, pos + 4)
        start = pos + 8
        end = min(start + size, len(data))  # streamed WAVs may claim 0xFFFFFFFF
        if chunk_id == b"fmt ":
            if end - start < 16:
                raise _invalid(where, "WAV 'fmt ' chunk is truncated")
            tag, channels, rate, _byte_rate, _align, bits = struct.unpack_from("<HHIIHH", data, start)
            if tag == _FORMAT_EXTENSIBLE and end - start >= 26:
                (tag,) = struct.unpack_from("<H", data, start + 24)  # the sub-format GUID starts with the tag
            fmt = (tag, channels, rate, bits)
        elif chunk_id == b"data":
            if fmt is None:
                raise _invalid(where, "WAV 'data' chunk comes before 'fmt '")
            return (*fmt, view[start:end])
        pos = start + size + (size & 1)  # chunks are padded to even sizes
    raise _invalid(where, "WAV file has no 'data' chunk")


def _samples(raw: np.ndarray, tag: int, bits: int) -> np.ndarray:
    if tag == _FORMAT_FLOAT:
        return raw.view("<f4" if bits == 32 else "<f8").astype(np.float32)
    if bits == 8:  # 8-bit WAV is unsigned
        return (raw.astype(np.float32) - 128.0) / 128.0
    if bits == 24:
        b = raw.reshape(-1, 3).astype(np.int32)
        ints = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        ints = np.where(ints >= 1 << 23, ints - (1 << 24), ints)
        return ints.astype(np.float32) / float(1 << 23)
    return raw.view("<i2" if bits == 16 else "<i4").astype(np.float32) / float(1 << (bits - 1))


def decode_wav(data: bytes, where: str = "audio item 0", limits: MediaLimits = OFFLINE) -> DecodedAudio:
    """Decode WAV bytes to mono float32 at the file's rate, checking the
    duration against ``limits.max_audio_seconds`` before converting samples."""
    tag, channels, rate, bits, payload = _parse_header(data, where)
    if tag not in _SUPPORTED_BITS or bits not in _SUPPORTED_BITS[tag]:
        raise _invalid(
            where,
            f"unsupported WAV encoding (format tag {tag}, {bits} bits); use PCM 8/16/24/32-bit or float 32/64-bit",
        )
    if channels < 1 or not 1 <= rate <= MAX_SAMPLE_RATE:
        raise _invalid(where, f"invalid WAV header ({channels} channels, {rate} Hz)")
    frame_bytes = channels * bits // 8
    frames = len(payload) // frame_bytes
    if frames == 0:
        raise _invalid(where, "the WAV file has no samples")
    duration = frames / rate
    if limits.max_audio_seconds is not None and duration > limits.max_audio_seconds:
        raise MediaError(
            where,
            f"audio is {duration:.1f} s long, over the limit of {limits.max_audio_seconds:g} s",
            "audio_too_long",
        )
    raw = np.frombuffer(payload[: frames * frame_bytes], dtype=np.uint8)
    samples = _samples(raw, tag, bits).reshape(frames, channels).mean(axis=1, dtype=np.float32)
    if not np.isfinite(samples).all():
        raise _invalid(where, "the audio holds NaN or infinite samples")
    return DecodedAudio(np.ascontiguousarray(samples), rate)


def encode_pcm16(audio: np.ndarray) -> bytes:
    """A float waveform in [-1, 1] as little-endian 16-bit PCM (samples clipped,
    scaled by 32767 and rounded): the samples of ``encode_wav``'s file."""
    return (np.clip(np.asarray(audio, dtype=np.float32), -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()


# RIFF and data sizes of a WAV whose length is not known when its header is sent.
WAV_UNKNOWN_SIZE = 0xFFFFFFFF


def streaming_wav_header(sample_rate: int) -> bytes:
    """The 44-byte header of a 16-bit mono PCM WAV of unknown length (RIFF and
    data sizes 0xFFFFFFFF, as OpenAI's streamed WAV): sent once, then raw PCM."""
    rate = int(sample_rate)
    return (
        b"RIFF" + struct.pack("<I", WAV_UNKNOWN_SIZE) + b"WAVE"
        + b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16)
        + b"data" + struct.pack("<I", WAV_UNKNOWN_SIZE)
    )  # fmt: skip


def encode_wav(audio: np.ndarray, sample_rate: int) -> bytes:
    """A float waveform in [-1, 1] as the bytes of a 16-bit PCM mono WAV file
    (samples clipped, scaled by 32767 and rounded)."""
    pcm = encode_pcm16(audio)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(int(sample_rate))
        f.writeframes(pcm)
    return buf.getvalue()


def write_wav(path: str | Path, audio: np.ndarray, sample_rate: int) -> Path:
    """Write a float waveform in [-1, 1] as 16-bit PCM mono WAV (for the CLI)."""
    path = Path(path)
    path.write_bytes(encode_wav(audio, sample_rate))
    return path
