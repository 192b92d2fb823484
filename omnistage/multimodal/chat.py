"""OpenAI-style chat content parts -> template-ready messages + ``multi_modal_data``.

Accepted parts (in a message's ``content`` list):

| part | item |
|---|---|
| ``{"type": "text", "text": str}`` | (text) |
| ``{"type": "image_url", "image_url": {"url": data URL / path / file:// URL}}`` | image |
| ``{"type": "image", "image": PIL image / uint8 array / path / bytes}`` | image |
| ``{"type": "input_audio", "input_audio": {"data": base64 WAV, "format": "wav"}}`` | audio |
| ``{"type": "audio", "audio": (waveform, sample_rate) / path}`` | audio |
| ``{"type": "audio_url", "audio_url": {"url": data URL / path}}`` | audio |
| ``{"type": "video", "video": uint8 [T, H, W, 3] frames or (frames, {"fps": x})}`` | video |

Each media part becomes a bare ``{"type": "image" | "audio" | "video"}``
part, which the Qwen chat templates render as the modality's placeholder
(the media itself never enters the template), and its item is appended to
``multi_modal_data[modality]`` in message order, the order in which the
template emits the placeholders. Messages without media pass unchanged.

Given the model's input modalities, a part of another modality is refused
for that before anything of it is read: audio sent to a text model is that,
whatever its bytes or format (the OpenAI server checks in the same order).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

__all__ = ["split_chat_media"]

_DIRECT = {"image": "image", "audio": "audio", "video": "video"}
_URL = {"image_url": "image", "audio_url": "audio", "video_url": "video"}
_MODALITY_OF_PART = {**_DIRECT, **_URL, "input_audio": "audio"}


def _url(part: Mapping[str, Any], key: str, where: str) -> str:
    value = part.get(key)
    if isinstance(value, Mapping):
        value = value.get("url")
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where}: expected {key!r} to be a URL string or {{'url': ...}}, got {type(value).__name__}")
    return value


def _item(part: Mapping[str, Any], kind: str, where: str) -> tuple[str, Any]:
    if kind in _DIRECT:
        if part.get(kind) is None:
            raise ValueError(f"{where}: a {kind!r} part needs its {kind} under the key {kind!r}")
        return _DIRECT[kind], part[kind]
    if kind in _URL:
        if kind == "video_url":
            raise ValueError(f"{where}: video URLs cannot be decoded (no video codec); pass frames in a 'video' part")
        return _URL[kind], _url(part, kind, where)
    if kind == "input_audio":
        audio = part.get("input_audio")
        if not isinstance(audio, Mapping) or not isinstance(audio.get("data"), str):
            raise ValueError(f"{where}: expected 'input_audio' to be {{'data': base64, 'format': 'wav'}}")
        fmt = str(audio.get("format", "wav")).lower()
        if fmt != "wav":
            raise ValueError(f"{where}: input_audio format {fmt!r} cannot be decoded; send WAV")
        return "audio", "data:audio/wav;base64," + audio["data"]
    raise ValueError(
        f"{where}: unsupported content part type {kind!r}; expected text, image_url, image, "
        "input_audio, audio, audio_url or video"
    )


def split_chat_media(
    messages: Sequence[Mapping[str, Any]],
    input_modalities: Collection[str] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, list[Any]]]:
    """``(messages for the chat template, multi_modal_data)``; see the module docstring.
    ``input_modalities``: what the model takes (None: any modality)."""
    out: list[dict[str, Any]] = []
    data: dict[str, list[Any]] = {}
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}]: expected a message dict, got {type(message).__name__}")
        content = message.get("content")
        if isinstance(content, str) or content is None:
            out.append(dict(message))
            continue
        if not isinstance(content, (list, tuple)):
            raise ValueError(
                f"messages[{i}].content: expected a string or a list of content parts, got {type(content).__name__}"
            )
        parts: list[Any] = []
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            if not isinstance(part, Mapping) or "type" not in part:
                raise ValueError(f"{where}: expected a content part dict with a 'type'")
            kind = part["type"]
            if kind == "text":
                parts.append(dict(part))
                continue
            modality = _MODALITY_OF_PART.get(kind)
            if input_modalities is not None and modality is not None and modality not in input_modalities:
                raise ValueError(
                    f"{where}: this model does not take {modality} input (it takes {sorted(input_modalities)})"
                )
            modality, item = _item(part, kind, where)
            data.setdefault(modality, []).append(item)
            parts.append({"type": modality})
        out.append({**message, "content": parts})
    return out, data
