"""Where media bytes come from, what an item may be, and how decoding fails.

A string source is a ``data:<mime>;base64,`` URL, a ``file://`` URL or a
local path; ``http(s)://`` URLs are never fetched (the offline engine has no
network and the server must not fetch on a client's behalf), and any other
``scheme://`` is refused. Bytes are taken as they are.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
from dataclasses import dataclass
from urllib.parse import unquote, urlparse

__all__ = ["MediaError", "MediaLimits", "decode_base64", "parse_data_url", "read_media_bytes"]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


class MediaError(ValueError):
    """A media item that cannot be used. ``str(exc)`` is ``"<where>: <detail>"``;
    ``where`` names the item (``image item 2``, or the server's request field)
    and ``code`` is a stable machine name for the problem (the server sends it
    as the OpenAI error ``code``)."""

    def __init__(self, where: str, detail: str, code: str) -> None:
        super().__init__(f"{where}: {detail}")
        self.where = where
        self.detail = detail
        self.code = code


@dataclass(frozen=True)
class MediaLimits:
    """Bounds on one item and on where local files may come from.

    The defaults suit a trusted caller (``LLM``, the processor): no bounds
    beyond PIL's decompression-bomb guard, and any local path. The server
    (``entrypoints/openai/media.py``) sets every bound and turns local files
    off unless it was given a directory. Bounds are checked from headers
    before a payload is decoded, so an oversized item costs a header parse.

    - ``local_files``: whether paths and ``file://`` URLs are read at all;
    - ``allowed_local_media_path``: when set, only files that resolve
      (symlinks followed) under this directory are read, and paths holding
      ``..`` are refused outright;
    - ``max_media_bytes``: the largest local file read.
    """

    max_image_pixels: int | None = None
    max_audio_seconds: float | None = None
    max_media_bytes: int | None = None
    local_files: bool = True
    allowed_local_media_path: str | None = None


OFFLINE = MediaLimits()


def decode_base64(data: str, where: str) -> bytes:
    """Strict base64; whitespace is dropped first, since some clients wrap lines."""
    compact = "".join(data.split())
    if not compact:
        raise MediaError(where, "empty base64 payload", "invalid_base64")
    try:
        return base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(where, f"invalid base64 data ({exc})", "invalid_base64") from None


def parse_data_url(url: str, where: str) -> tuple[str, bytes]:
    """``data:<mime>[;...];base64,<payload>`` as ``(mime, bytes)``. Only base64
    payloads are taken: binary media is never sent percent-encoded in practice."""
    header, sep, payload = url[len("data:") :].partition(",")
    if not sep:
        raise MediaError(where, "malformed data URL (no ',' separating header and data)", "invalid_data_url")
    fields = header.split(";")
    if "base64" not in (f.strip().lower() for f in fields[1:]):
        raise MediaError(where, "data URLs must be base64-encoded (';base64,')", "invalid_data_url")
    return fields[0].strip().lower(), decode_base64(payload, where)


def _read_local_file(path: str, where: str, limits: MediaLimits) -> bytes:
    if not limits.local_files:
        raise MediaError(
            where,
            "local media files are disabled; start the server with --allowed-local-media-path "
            "(MediaLimits.allowed_local_media_path) to allow a directory",
            "local_media_disabled",
        )
    if limits.allowed_local_media_path is not None:
        # '..' is refused before resolving: even when the result would land
        # inside the directory, a client sending '..' is probing.
        if ".." in re.split(r"[/\\]", path):
            raise MediaError(where, "'..' is not allowed in local media paths", "path_not_allowed")
        root = os.path.realpath(limits.allowed_local_media_path)
        resolved = os.path.realpath(path)  # a symlink out of the root is caught here
        if os.path.commonpath([root, resolved]) != root:
            raise MediaError(where, f"{path!r} is outside the allowed local media directory", "path_not_allowed")
        path = resolved
    if not os.path.isfile(path):
        raise MediaError(
            where, f"{path!r} is not a readable file; expected a local path, a data URL or bytes", "file_not_found"
        )
    size = os.path.getsize(path)
    if limits.max_media_bytes is not None and size > limits.max_media_bytes:
        raise MediaError(where, f"file is {size} bytes, over the limit of {limits.max_media_bytes}", "media_too_large")
    with open(path, "rb") as f:
        return f.read()


def read_media_bytes(source: str | bytes | bytearray | memoryview, kind: str, where: str, limits: MediaLimits) -> bytes:
    """The bytes of a ``kind`` (``"image"`` / ``"audio"``) item given as a data
    URL, ``file://`` URL, local path or raw bytes; a data URL's media type must
    be ``kind/...``."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source)
    if source[:5].lower() == "data:":
        mime, data = parse_data_url(source, where)
        if not mime.startswith(f"{kind}/"):
            raise MediaError(
                where,
                f"expected an {kind} data URL (data:{kind}/...;base64,...), got media type {mime!r}",
                "invalid_media_type",
            )
        return data
    match = _SCHEME.match(source)
    scheme = match.group(1).lower() if match else ""
    if scheme in ("http", "https"):
        raise MediaError(
            where,
            "remote URLs are not fetched; download the file and pass a local path or bytes, or send a base64 data URL",
            "remote_url_not_allowed",
        )
    if scheme == "file":
        parsed = urlparse(source)
        if parsed.netloc not in ("", "localhost"):
            raise MediaError(where, f"file URLs must name a local path, got host {parsed.netloc!r}", "invalid_url")
        return _read_local_file(unquote(parsed.path), where, limits)
    if scheme:
        raise MediaError(
            where,
            f"unsupported URL scheme {scheme!r}; expected a data URL, a file:// URL or a local path",
            "invalid_url",
        )
    return _read_local_file(source, where, limits)
