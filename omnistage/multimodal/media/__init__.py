"""Decoding of user-supplied media into the arrays the processors take; the
one media module of the offline API and the server.

- images (``image.py``): a PIL image, a ``data:image/...;base64,`` URL, a
  local path or ``file://`` URL, raw encoded bytes, or an ``[H, W, C]`` uint8
  array;
- audio (``audio.py``, ``wav.py``): a ``(waveform, sample_rate)`` pair with a
  1-D float waveform, or a WAV file (PCM 8/16/24/32-bit, float 32/64-bit, any
  channel count, averaged to mono) as bytes, data URL, path or base64
  ``input_audio``; resampled to the model's rate;
- video (``video.py``): an ``[T, H, W, C]`` (or ``[T, H, W]`` grey) uint8
  frames array or tensor, or a list of images (frames), optionally paired
  with metadata as ``(frames, {"fps": 2.0})``. No container decoding: there
  is no video codec library in the environment;
- sources and bounds (``source.py``): ``MediaLimits`` holds the bounds on an
  item (pixels, seconds, file bytes) and where local files may come from; the
  default trusts the caller, the server sets every bound. Remote
  ``http(s)://`` URLs are always refused.

The WAV writer (``encode_wav``, ``write_wav``, and for streams
``streaming_wav_header`` + ``encode_pcm16``) sits beside the reader.
Every failure is a ``MediaError`` (a ``ValueError``) naming the item
(``image item 2``) and what was expected, with a ``code`` the server sends.
"""

from omnistage.multimodal.media.audio import decode_input_audio, load_audio, resample_audio
from omnistage.multimodal.media.image import decode_image_bytes, load_image
from omnistage.multimodal.media.source import (
    OFFLINE,
    MediaError,
    MediaLimits,
    decode_base64,
    parse_data_url,
    read_media_bytes,
)
from omnistage.multimodal.media.video import DecodedVideo, load_video
from omnistage.multimodal.media.wav import (
    DecodedAudio,
    decode_wav,
    encode_pcm16,
    encode_wav,
    streaming_wav_header,
    write_wav,
)

__all__ = [
    "OFFLINE",
    "DecodedAudio",
    "DecodedVideo",
    "MediaError",
    "MediaLimits",
    "decode_base64",
    "decode_image_bytes",
    "decode_input_audio",
    "decode_wav",
    "encode_pcm16",
    "encode_wav",
    "load_audio",
    "load_image",
    "load_video",
    "parse_data_url",
    "read_media_bytes",
    "resample_audio",
    "streaming_wav_header",
    "write_wav",
]
