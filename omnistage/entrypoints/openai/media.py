"""The server's media policy on top of ``omnistage.multimodal.media``.

Decoding is the offline API's (one module: the same formats and the same
messages); this adapter adds what a server owes its clients:

- every bound set (``server_media_limits``): pixels, audio seconds, local
  file bytes; local files (``file://`` URLs or paths) are read only from
  under ``--allowed-local-media-path`` and are refused without it;
- every ``MediaError`` answered as a 400 ``APIError`` whose ``param`` is the
  offending request field and whose ``code`` is the error's
  (``invalid_image``, ``audio_too_long``, ``path_not_allowed``, ...);
- images converted to RGB, the form the model processors take.
"""

from __future__ import annotations

from PIL import Image

from omnistage.entrypoints.openai.errors import APIError, bad_request
from omnistage.multimodal import media
from omnistage.multimodal.media import DecodedAudio, MediaError, MediaLimits

__all__ = [
    "DEFAULT_MAX_AUDIO_SECONDS",
    "DEFAULT_MAX_IMAGE_PIXELS",
    "DEFAULT_MAX_MEDIA_BYTES",
    "DecodedAudio",
    "MediaLimits",
    "api_error",
    "decode_audio",
    "load_image",
    "server_media_limits",
]

DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096
DEFAULT_MAX_AUDIO_SECONDS = 600.0
DEFAULT_MAX_MEDIA_BYTES = 16 * 1024 * 1024  # for local files; request bodies are bounded separately


def server_media_limits(
    allowed_local_media_path: str | None = None,
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    max_audio_seconds: float = DEFAULT_MAX_AUDIO_SECONDS,
    max_media_bytes: int = DEFAULT_MAX_MEDIA_BYTES,
) -> MediaLimits:
    """The server's bounds: all set, local files only under the given directory."""
    return MediaLimits(
        max_image_pixels=max_image_pixels,
        max_audio_seconds=max_audio_seconds,
        max_media_bytes=max_media_bytes,
        local_files=allowed_local_media_path is not None,
        allowed_local_media_path=allowed_local_media_path,
    )


def api_error(exc: MediaError) -> APIError:
    return bad_request(str(exc), param=exc.where, code=exc.code)


def load_image(url: str, limits: MediaLimits, param: str) -> Image.Image:
    """An ``image_url.url`` (data URL or allowed ``file://``) decoded to RGB."""
    try:
        return media.load_image(url, param, limits).convert("RGB")
    except MediaError as exc:
        raise api_error(exc) from None


def decode_audio(data_b64: str, fmt: str, limits: MediaLimits, param: str) -> DecodedAudio:
    """An ``input_audio`` part at its own rate (the engine's processor resamples)."""
    try:
        return media.decode_input_audio(data_b64, fmt, param, limits)
    except MediaError as exc:
        raise api_error(exc) from None
