"""Prompt + media -> prompt token ids + ``MultiModalFeatureSpec`` list.

``MultiModalProcessor.from_pretrained(path)`` builds the pieces of the
checkpoint's own transformers processor from its files: the tokenizer, the
image processor (PIL backend), the audio feature extractor, and the video
preprocessing of ``video_processing.py`` (transformers' video processor needs
torchvision; see docs/multimodal.md). ``process`` then does what the
processor does: one placeholder token per item in the prompt
(``<|image_pad|>`` / ``<|video_pad|>`` for Qwen2.5-VL, ``<|IMAGE|>`` /
``<|VIDEO|>`` / ``<|AUDIO|>`` for Qwen2.5-Omni) is expanded to as many tokens
as the item has encoder embeddings.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from omnistage.multimodal.hashing import hash_audio, hash_image, hash_video
from omnistage.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from omnistage.multimodal.media import load_audio, load_image, load_video
from omnistage.multimodal.processor_config import processor_settings
from omnistage.multimodal.video_processing import QwenVideoPreprocessor

__all__ = ["MultiModalProcessor", "ProcessedPrompt", "audio_output_length", "qwen3_audio_output_length"]

_MODALITIES = ("image", "video", "audio")
_OPTION_KEYS = {
    "image": {"min_pixels", "max_pixels", "size"},
    "video": {"min_pixels", "max_pixels", "size", "fps", "cap_pixels_per_frame"},
    "audio": set(),
}
_KWARGS_NAMES = {"images_kwargs": "image", "videos_kwargs": "video", "audio_kwargs": "audio"}
# Qwen2.5-Omni's processor passes this video size to the video processor on
# every call, whatever the checkpoint's video settings say (a processor
# attribute merged into each call's video kwargs), so every Omni checkpoint
# gets it here too: one re-saved by transformers 5, with a video block of its
# own, answers as transformers does.
_OMNI_VIDEO_SIZE = {"shortest_edge": 128 * 28 * 28, "longest_edge": 768 * 28 * 28}
# Qwen3-Omni's processor does the same with its 32-pixel merged patches.
_QWEN3_OMNI_VIDEO_SIZE = {"shortest_edge": 128 * 32 * 32, "longest_edge": 768 * 32 * 32}
_MAX_AUDIO_SECONDS = 30  # the feature extractor's window; longer clips are refused, not truncated
# The most pixels a request may ask an image or frame to be resized to: beyond any encoder cache
# (83k embeddings at 28-pixel merged patches), and a resize that large would exhaust memory first.
_MAX_OPTION_PIXELS = 8192 * 8192


def audio_output_length(num_frames: int) -> int:
    """Audio-tower output rows for ``num_frames`` mel frames (conv stride 2,
    then pooling stride 2)."""
    return ((num_frames - 1) // 2 + 1 - 2) // 2 + 1


def qwen3_audio_output_length(num_frames: int, n_window: int = 50) -> int:
    """Qwen3-Omni audio-tower output rows for ``num_frames`` mel frames (transformers'
    ``_get_feat_extract_output_lengths``: each whole chunk of ``2 * n_window`` frames gives 13)."""
    chunk = 2 * n_window
    feat = (num_frames % chunk - 1) // 2 + 1
    return ((feat - 1) // 2 + 1 - 1) // 2 + 1 + (num_frames // chunk) * 13


@dataclass
class ProcessedPrompt:
    prompt_token_ids: list[int]
    mm_features: list[MultiModalFeatureSpec] = field(default_factory=list)


def _check_option(where: str, name: str, value: Any) -> Any:
    """A request's processor option, checked: pixel counts are integers in
    [1, _MAX_OPTION_PIXELS], ``size`` holds them as ``shortest_edge`` / ``longest_edge``,
    ``fps`` is a positive finite number and ``cap_pixels_per_frame`` a bool."""
    if name == "fps":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ValueError(f"{where}: expected a positive number of frames per second, got {value!r}")
        return value
    if name == "cap_pixels_per_frame":
        if not isinstance(value, bool):
            raise ValueError(f"{where}: expected true or false, got {value!r}")
        return value
    if name == "size":
        if not isinstance(value, Mapping) or not value or set(value) - {"shortest_edge", "longest_edge"}:
            raise ValueError(f"{where}: expected {{'shortest_edge': pixels, 'longest_edge': pixels}}, got {value!r}")
        return {edge: _check_option(f"{where}.{edge}", "pixels", v) for edge, v in value.items()}
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _MAX_OPTION_PIXELS:
        raise ValueError(f"{where}: expected a whole number of pixels in [1, {_MAX_OPTION_PIXELS}], got {value!r}")
    return value


class MultiModalProcessor:
    """Turns ``{"prompt" | "prompt_token_ids", "multi_modal_data",
    "mm_processor_kwargs"}`` into token ids and sorted feature specs."""

    def __init__(self, model_path: str | os.PathLike, tokenizer: Any = None) -> None:
        from transformers import AutoConfig, AutoFeatureExtractor, AutoImageProcessor, AutoTokenizer

        path = os.fspath(model_path)
        config = AutoConfig.from_pretrained(path)
        if config.model_type in ("qwen2_5_omni", "qwen3_omni_moe"):
            config = config.thinker_config
        if config.model_type not in ("qwen2_5_vl", "qwen2_5_omni_thinker", "qwen3_omni_moe_thinker"):
            raise ValueError(
                f"MultiModalProcessor: model_type {config.model_type!r} is not supported; "
                "expected qwen2_5_vl, qwen2_5_omni(_thinker) or qwen3_omni_moe"
            )
        self.is_omni = config.model_type in ("qwen2_5_omni_thinker", "qwen3_omni_moe_thinker")
        is_qwen3 = config.model_type == "qwen3_omni_moe_thinker"
        n_window = int(getattr(getattr(config, "audio_config", None), "n_window", 50))
        self._audio_length = (lambda n: qwen3_audio_output_length(n, n_window)) if is_qwen3 else audio_output_length
        self.config = config
        self.tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(path)
        self.image_processor = AutoImageProcessor.from_pretrained(path, backend="pil")
        # image and audio: transformers' own loaders, which read both layouts;
        # video: ours (no torchvision), reading them in the same precedence
        video_settings = processor_settings(path, "video")
        self.video_processor = (
            QwenVideoPreprocessor.from_dict(video_settings.values) if video_settings else QwenVideoPreprocessor()
        )
        if self.is_omni:
            size = _QWEN3_OMNI_VIDEO_SIZE if is_qwen3 else _OMNI_VIDEO_SIZE
            self.video_processor = self.video_processor.with_options({"size": dict(size)})
        self.feature_extractor = AutoFeatureExtractor.from_pretrained(path) if self.is_omni else None
        self.merge_size = config.vision_config.spatial_merge_size
        self.placeholder_ids = {"image": config.image_token_id, "video": config.video_token_id}
        if self.is_omni:
            self.placeholder_ids["audio"] = config.audio_token_id
        # default fps when a video comes without one: transformers' Qwen2.5-VL
        # processor falls back to 24, the Qwen2.5-Omni processor to 2.0, Qwen3-Omni's to 1.0
        self.default_fps = 1.0 if is_qwen3 else 2.0 if self.is_omni else 24.0

    @classmethod
    def from_pretrained(cls, model_path: str | os.PathLike, tokenizer: Any = None) -> MultiModalProcessor:
        return cls(model_path, tokenizer)

    @property
    def modalities(self) -> tuple[str, ...]:
        return tuple(self.placeholder_ids)

    def placeholder_token(self, modality: str) -> str:
        return self.tokenizer.convert_ids_to_tokens(self.placeholder_ids[modality])

    # ------------------------------------------------------------- budgets

    def max_tokens_per_item(self, max_video_frames: int = 32) -> dict[str, int]:
        """Largest number of encoder embeddings one item can have, per
        modality, for sizing the encoder budgets. Videos are bounded by
        ``max_video_frames`` frames."""
        unit = (self.image_processor.patch_size * self.merge_size) ** 2
        out = {
            "image": self.image_processor.size["longest_edge"] // unit,
            "video": -(-max_video_frames // self.video_processor.temporal_patch_size)
            * (self.video_processor.size["longest_edge"] // unit),
        }
        if self.is_omni:
            out["audio"] = self._audio_length(self.feature_extractor.nb_max_frames)
        return out

    def encoder_settings(self) -> dict[str, Any]:
        """Every processor setting that shapes an item's encoder input
        (resize bounds, patch sizes, normalization, fps default, mel
        settings). Item identifiers hash the content and the request's
        options only; an encoder output shared beyond this processor (the
        encoder workers' object store) is also keyed by these."""
        import dataclasses

        settings: dict[str, Any] = {
            "image": self.image_processor.to_dict(),
            "video": dataclasses.asdict(self.video_processor),
            "merge_size": self.merge_size,
            "default_fps": self.default_fps,
        }
        if self.feature_extractor is not None:
            settings["audio"] = self.feature_extractor.to_dict()
        return settings

    # ---------------------------------------------------------------- items

    def _image(self, source: Any, where: str, options: dict[str, Any]) -> tuple[dict[str, Any], int, str]:
        image = load_image(source, where)
        call = dict(options)
        if "min_pixels" in call or "max_pixels" in call:  # the non-deprecated spelling
            base = self.image_processor.size
            size = {"shortest_edge": base["shortest_edge"], "longest_edge": base["longest_edge"]}
            size.update(call.pop("size", {}))
            if "min_pixels" in call:
                size["shortest_edge"] = call.pop("min_pixels")
            if "max_pixels" in call:
                size["longest_edge"] = call.pop("max_pixels")
            call["size"] = size
        try:
            out = self.image_processor(images=[image], return_tensors="pt", **call)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        grid = out["image_grid_thw"].to(torch.int64)
        data = {"pixel_values": out["pixel_values"].to(torch.float32), "image_grid_thw": grid}
        return data, int(grid.prod()) // self.merge_size**2, hash_image(image, options)

    def _video(self, source: Any, where: str, options: dict[str, Any]) -> tuple[dict[str, Any], int, str]:
        video = load_video(source, where)
        fps = float(video.metadata.get("fps") or options.get("fps") or self.default_fps)
        processor = self.video_processor.with_options({k: v for k, v in options.items() if k != "fps"})
        try:
            pixels, (t, h, w) = processor(video.frames)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        data = {
            "pixel_values_videos": pixels,
            "video_grid_thw": torch.tensor([[t, h, w]], dtype=torch.int64),
            "second_per_grid_ts": torch.tensor([processor.temporal_patch_size / fps], dtype=torch.float32),
        }
        identifier = hash_video(video.frames, {**options, "fps": fps})
        return data, t * h * w // self.merge_size**2, identifier

    def _audio(self, source: Any, where: str, options: dict[str, Any]) -> tuple[dict[str, Any], int, str]:
        fe = self.feature_extractor
        waveform, _ = load_audio(source, fe.sampling_rate, where)
        if len(waveform) > fe.n_samples:
            raise ValueError(
                f"{where}: the clip is {len(waveform) / fe.sampling_rate:.2f} s long; the audio encoder "
                f"takes at most {fe.n_samples / fe.sampling_rate:.0f} s per item, split it into several items"
            )
        # exactly as Qwen2.5-Omni's processor calls it: padded to the 30 s window
        out = fe(
            [waveform],
            sampling_rate=fe.sampling_rate,
            padding="max_length",
            return_attention_mask=True,
            return_tensors="pt",
        )
        num_frames = int(out["attention_mask"][0].sum())
        features = out["input_features"][0, :, :num_frames].to(torch.float32).contiguous()
        num_tokens = self._audio_length(num_frames)
        if num_tokens < 1:  # its placeholder would vanish from the prompt and the clip be ignored silently
            shortest = next(n for n in range(1, 1000) if self._audio_length(n) >= 1)
            hop_ms = 1000 * fe.hop_length / fe.sampling_rate
            raise ValueError(
                f"{where}: the clip is {1000 * len(waveform) / fe.sampling_rate:.1f} ms long ({num_frames} mel "
                f"frame(s)), too short for the audio encoder to give an embedding; expected more than "
                f"{(shortest - 1) * hop_ms:.0f} ms"
            )
        data = {"input_features": features, "audio_feature_lengths": torch.tensor([num_frames], dtype=torch.int64)}
        # hashed at the model's rate: equal sound shares however it was supplied
        identifier = hash_audio(waveform, fe.sampling_rate, options)
        return data, num_tokens, identifier

    # -------------------------------------------------------------- prompts

    def _options(self, kwargs: Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:
        options: dict[str, dict[str, Any]] = {m: {} for m in _MODALITIES}
        if kwargs is not None and not isinstance(kwargs, Mapping):
            raise ValueError(f"mm_processor_kwargs: expected a dict, got {type(kwargs).__name__}")
        for key, value in (kwargs or {}).items():
            if key == "use_audio_in_video" and not value:
                continue
            if key == "fps":
                options["video"]["fps"] = _check_option("mm_processor_kwargs.fps", "fps", value)
                continue
            modality = _KWARGS_NAMES.get(key)
            if modality is None or not isinstance(value, Mapping):
                raise ValueError(
                    f"mm_processor_kwargs: unsupported key {key!r}; expected images_kwargs, videos_kwargs, "
                    "audio_kwargs (dicts) or fps (use_audio_in_video is not supported)"
                )
            unknown = set(value) - _OPTION_KEYS[modality]
            if unknown:
                raise ValueError(
                    f"mm_processor_kwargs.{key}: unsupported option(s) {sorted(unknown)}; "
                    f"expected a subset of {sorted(_OPTION_KEYS[modality])}"
                )
            for name, v in value.items():
                options[modality][name] = _check_option(f"mm_processor_kwargs.{key}.{name}", name, v)
            lowest, highest = options[modality].get("min_pixels"), options[modality].get("max_pixels")
            if lowest is not None and highest is not None and lowest > highest:
                raise ValueError(f"mm_processor_kwargs.{key}: min_pixels ({lowest}) exceeds max_pixels ({highest})")
        return options

    def process(self, inputs: str | Mapping[str, Any]) -> ProcessedPrompt:
        if isinstance(inputs, str):
            inputs = {"prompt": inputs}
        if "prompt_token_ids" in inputs:
            token_ids = [int(t) for t in inputs["prompt_token_ids"]]
        elif isinstance(inputs.get("prompt"), str):
            token_ids = list(self.tokenizer(inputs["prompt"])["input_ids"])
        else:
            raise ValueError("prompt: expected a 'prompt' string or 'prompt_token_ids'")
        mm_data = inputs.get("multi_modal_data") or {}
        options = self._options(inputs.get("mm_processor_kwargs"))
        items: dict[str, list[Any]] = {}
        for modality, value in mm_data.items():
            if modality not in self.placeholder_ids:
                raise ValueError(
                    f"multi_modal_data: modality {modality!r} is not supported by this model; "
                    f"expected one of {list(self.placeholder_ids)}"
                )
            if value is None:
                continue
            # a list holds several items; anything else (a tuple too) is one item
            items[modality] = list(value) if isinstance(value, list) else [value]

        positions = {m: [i for i, t in enumerate(token_ids) if t == pid] for m, pid in self.placeholder_ids.items()}
        for modality, pos in positions.items():
            given = len(items.get(modality, []))
            token = self.placeholder_token(modality)
            if given > len(pos):
                raise ValueError(
                    f"{modality} item {len(pos)}: the prompt has {len(pos)} {token} placeholder(s) for "
                    f"{given} {modality} item(s); expected one placeholder per item"
                )
            if given < len(pos):
                raise ValueError(
                    f"{modality} item {given}: missing; the prompt has {len(pos)} {token} placeholders "
                    f"but {given} {modality} item(s) were given; expected one item per placeholder"
                )

        # process each item, then splice the expanded placeholders in prompt order
        encoders = {"image": self._image, "video": self._video, "audio": self._audio}
        found: list[tuple[int, str, int, dict[str, Any], int, str]] = []
        for modality, sources in items.items():
            for k, source in enumerate(sources):
                data, num_tokens, identifier = encoders[modality](source, f"{modality} item {k}", options[modality])
                found.append((positions[modality][k], modality, k, data, num_tokens, identifier))
        found.sort(key=lambda entry: entry[0])

        expanded: list[int] = []
        features: list[MultiModalFeatureSpec] = []
        cursor = 0
        previous = ""
        for position, modality, k, data, num_tokens, identifier in found:
            expanded.extend(token_ids[cursor:position])
            offset = len(expanded)
            if features and features[-1].mm_position.offset + features[-1].mm_position.length == offset:
                raise ValueError(
                    f"{modality} item {k}: its placeholder directly follows the one of {previous}; "
                    "expected the model's start/end tokens around every item"
                )
            previous = f"{modality} item {k}"
            expanded.extend([self.placeholder_ids[modality]] * num_tokens)
            features.append(
                MultiModalFeatureSpec(
                    data=data,
                    modality=modality,
                    identifier=identifier,
                    mm_position=PlaceholderRange(offset=offset, length=num_tokens),
                    mm_hash=identifier,
                )
            )
            cursor = position + 1
        expanded.extend(token_ids[cursor:])
        return ProcessedPrompt(expanded, features)

    def __call__(self, inputs: str | Mapping[str, Any]) -> ProcessedPrompt:
        return self.process(inputs)

    # -------------------------------------------------------------- helpers

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text for OpenAI-style messages (content parts of type
        text / image / image_url / video / audio / input_audio)."""
        return self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
        )
