"""WAV reading against files written by Python's ``wave`` module and by numpy,
for every sample encoding, and the WAV writer; plus ``soundfile`` /
``scipy.io.wavfile`` as references where they are installed."""

from __future__ import annotations

import base64
import io
import struct
import wave

import numpy as np
import pytest

from omnistage.multimodal.media import (
    MediaError,
    MediaLimits,
    decode_input_audio,
    decode_wav,
    encode_wav,
    load_audio,
    write_wav,
)

RATE = 8000
_WIDTH_DTYPE = {1: np.uint8, 2: np.int16, 3: np.int32, 4: np.int32}


def _random_ints(width: int, shape, seed: int = 0) -> np.ndarray:
    """Integer samples over a width's whole range, extremes included."""
    rng = np.random.default_rng(seed)
    if width == 1:
        lo, hi = 0, 255
    else:
        lo, hi = -(1 << (8 * width - 1)), (1 << (8 * width - 1)) - 1
    ints = rng.integers(lo, hi, size=shape, endpoint=True, dtype=np.int64)
    ints.reshape(-1)[:2] = lo, hi
    return ints


def _pcm_wav(ints: np.ndarray, width: int, rate: int = RATE) -> bytes:
    """Through Python's ``wave`` module; ``ints`` [frames] or [frames, channels]."""
    channels = 1 if ints.ndim == 1 else ints.shape[1]
    if width == 3:
        frames = b"".join(int(v).to_bytes(3, "little", signed=True) for v in ints.reshape(-1))
    else:
        frames = ints.astype(np.dtype(_WIDTH_DTYPE[width]).newbyteorder("<")).tobytes()
    buf = io.BytesIO()
    with wave.open(buf, "wb") as f:
        f.setnchannels(channels)
        f.setsampwidth(width)
        f.setframerate(rate)
        f.writeframes(frames)
    return buf.getvalue()


def _riff(tag: int, bits: int, channels: int, rate: int, data: bytes, extensible: bool = False, extra=b"") -> bytes:
    """A RIFF/WAVE file built by hand (``wave`` writes PCM only)."""
    align = channels * bits // 8
    fmt_tag = 0xFFFE if extensible else tag
    fmt = struct.pack("<HHIIHH", fmt_tag, channels, rate, rate * align, align, bits)
    if extensible:  # cbSize, valid bits, channel mask, sub-format GUID (tag + the fixed tail)
        guid_tail = b"\x00\x00\x00\x00\x10\x00\x80\x00\x00\xaa\x00\x38\x9b\x71"
        fmt += struct.pack("<HHIH", 22, bits, 0, tag) + guid_tail
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + extra
    body += b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


def _scaled(ints: np.ndarray, width: int) -> np.ndarray:
    """What libsndfile reads: integers over 2 ** (bits - 1); 8-bit is unsigned around 128."""
    if width == 1:
        return (ints.astype(np.float64) - 128) / 128
    return ints.astype(np.float64) / float(1 << (8 * width - 1))


@pytest.mark.parametrize("width", [1, 2, 3, 4])
def test_pcm_widths_written_by_wave(width):
    ints = _random_ints(width, 1000)
    audio = decode_wav(_pcm_wav(ints, width))
    assert audio.sample_rate == RATE and audio.samples.dtype == np.float32 and audio.samples.shape == (1000,)
    # exact up to float32 rounding of each sample
    np.testing.assert_allclose(audio.samples, _scaled(ints, width), rtol=2**-24, atol=0)
    assert audio.samples.min() == -1.0 and audio.samples.max() <= 1.0  # 32-bit's top rounds to 1 in float32


@pytest.mark.parametrize("dtype", ["<f4", "<f8"])
def test_float_wav_written_by_numpy(dtype):
    x = np.random.default_rng(1).uniform(-1.5, 1.5, 777).astype(dtype)  # float WAVs may exceed [-1, 1]
    bits = np.dtype(dtype).itemsize * 8
    audio = decode_wav(_riff(3, bits, 1, 22050, x.tobytes()))
    assert audio.sample_rate == 22050
    np.testing.assert_array_equal(audio.samples, x.astype(np.float32))


@pytest.mark.parametrize("width", [1, 2, 3, 4])
def test_stereo_is_averaged_as_librosa_to_mono(width):
    ints = _random_ints(width, (500, 2), seed=width)
    audio = decode_wav(_pcm_wav(ints, width))
    expected = _scaled(ints, width).astype(np.float32).mean(axis=1)  # librosa.to_mono: the channel mean
    np.testing.assert_allclose(audio.samples, expected, rtol=0, atol=2**-23)


def test_float_stereo_and_extensible_headers():
    x = np.random.default_rng(2).uniform(-1, 1, (300, 2)).astype("<f4")
    audio = decode_wav(_riff(3, 32, 2, RATE, x.tobytes(), extensible=True))
    np.testing.assert_allclose(audio.samples, x.mean(axis=1), rtol=0, atol=1e-7)
    ints = _random_ints(3, 300)
    data = b"".join(int(v).to_bytes(3, "little", signed=True) for v in ints)
    audio = decode_wav(_riff(1, 24, 1, RATE, data, extensible=True))
    np.testing.assert_allclose(audio.samples, _scaled(ints, 3), rtol=2**-24, atol=0)


def test_chunks_before_data_are_skipped_with_their_padding():
    ints = _random_ints(2, 50)
    odd = b"LIST" + struct.pack("<I", 3) + b"abc" + b"\x00"  # odd size: one pad byte follows
    audio = decode_wav(_riff(1, 16, 1, RATE, ints.astype("<i2").tobytes(), extra=odd))
    np.testing.assert_array_equal(audio.samples, (ints / 32768).astype(np.float32))


@pytest.mark.parametrize("width", [2, 3])
def test_load_audio_takes_every_source_form(tmp_path, width):
    ints = _random_ints(width, 1600)
    wav = _pcm_wav(ints, width, rate=16000)
    path = tmp_path / "a.wav"
    path.write_bytes(wav)
    url = "data:audio/wav;base64," + base64.b64encode(wav).decode()
    expected = _scaled(ints, width).astype(np.float32)
    for source in (wav, str(path), f"file://{path}", url):
        out, sr = load_audio(source, 16000)
        assert sr == 16000
        np.testing.assert_array_equal(out, expected)
    out, sr = load_audio(_pcm_wav(ints, width, rate=8000), 16000)  # resampled like a pair would be
    assert sr == 8000
    np.testing.assert_array_equal(out, load_audio((expected, 8000), 16000)[0])


def test_decode_input_audio_names_the_field():
    wav = base64.b64encode(_pcm_wav(_random_ints(3, 100), 3)).decode()
    assert decode_input_audio(wav, "wav", "messages[0].content[0].input_audio").sample_rate == RATE
    with pytest.raises(MediaError) as info:
        decode_input_audio(wav, "mp3", "part")
    assert info.value.code == "unsupported_audio_format" and info.value.where == "part.format"
    with pytest.raises(MediaError) as info:
        decode_input_audio("%%%", "wav", "part")
    assert info.value.code == "invalid_base64" and info.value.where == "part.data"


@pytest.mark.parametrize(
    "data, words",
    [
        (b"RIFF....nope", "not a WAV (RIFF/WAVE) file"),
        (b"RIFF\x10\x00\x00\x00WAVEdata\x00\x00\x00\x00", "'data' chunk comes before 'fmt '"),
        (b"RIFF\x04\x00\x00\x00WAVE", "no 'data' chunk"),
        (b"RIFF\x10\x00\x00\x00WAVEfmt \x04\x00\x00\x00\x01\x00\x01\x00", "'fmt ' chunk is truncated"),
        (_riff(1, 12, 1, RATE, b"\x00" * 8), "unsupported WAV encoding (format tag 1, 12 bits)"),
        (_riff(2, 16, 1, RATE, b"\x00" * 8), "unsupported WAV encoding (format tag 2, 16 bits)"),  # ADPCM
        (_riff(1, 16, 1, 0, b"\x00" * 8), "invalid WAV header (1 channels, 0 Hz)"),
        (_riff(1, 16, 1, RATE, b""), "the WAV file has no samples"),
        (_riff(3, 32, 1, RATE, np.array([0, np.nan], "<f4").tobytes()), "NaN or infinite"),
    ],
)
def test_bad_wavs(data, words):
    with pytest.raises(MediaError) as info:
        decode_wav(data, "audio item 4")
    assert info.value.code == "invalid_audio" and words in str(info.value)
    assert str(info.value).startswith("audio item 4: ")


def test_duration_checked_from_the_header(monkeypatch):
    wav = _pcm_wav(np.zeros(2 * RATE + 1, dtype=np.int64), 2)
    with pytest.raises(MediaError, match="audio is 2.0 s long, over the limit of 2 s") as info:
        decode_wav(wav, limits=MediaLimits(max_audio_seconds=2.0))
    assert info.value.code == "audio_too_long"
    import omnistage.multimodal.media.wav as wav_module

    monkeypatch.setattr(wav_module, "_samples", lambda *a: pytest.fail("converted an over-long clip"))
    with pytest.raises(MediaError):
        decode_wav(wav, limits=MediaLimits(max_audio_seconds=2.0))


def test_encode_wav_is_16_bit_mono_pcm(tmp_path):
    x = np.array([0.0, 0.5, -0.5, 1.0, -1.0, 2.0, -3.0, 1e-5], dtype=np.float32)
    data = encode_wav(x, 24000)
    with wave.open(io.BytesIO(data), "rb") as f:
        assert (f.getnchannels(), f.getsampwidth(), f.getframerate()) == (1, 2, 24000)
        ints = np.frombuffer(f.readframes(f.getnframes()), "<i2")
    np.testing.assert_array_equal(ints, [0, 16384, -16384, 32767, -32767, 32767, -32767, 0])
    decoded = decode_wav(data)
    np.testing.assert_array_equal(decoded.samples, ints / np.float32(32768))
    path = write_wav(tmp_path / "out.wav", x, 24000)
    assert path.read_bytes() == data


# ------------------------------------------------------- other readers, where installed (not dependencies)


@pytest.mark.parametrize("width", [1, 2, 3, 4])
def test_matches_soundfile(width):
    soundfile = pytest.importorskip("soundfile")
    wav = _pcm_wav(_random_ints(width, (400, 2)), width)
    reference, rate = soundfile.read(io.BytesIO(wav), dtype="float32")
    np.testing.assert_allclose(decode_wav(wav).samples, reference.mean(axis=1), rtol=0, atol=2**-23)
    assert rate == RATE


@pytest.mark.parametrize("width", [1, 2, 4])
def test_matches_scipy_wavfile(width):
    wavfile = pytest.importorskip("scipy.io.wavfile")
    ints = _random_ints(width, 400)
    rate, raw = wavfile.read(io.BytesIO(_pcm_wav(ints, width)))
    np.testing.assert_array_equal(raw, ints)  # scipy gives the integers; the scaling is libsndfile's
    np.testing.assert_allclose(decode_wav(_pcm_wav(ints, width)).samples, _scaled(raw, width), rtol=2**-24, atol=0)
