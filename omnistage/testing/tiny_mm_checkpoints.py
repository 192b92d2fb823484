"""Tiny, real multimodal checkpoints for tests, written offline.

Each writer saves a folder that loads like the published checkpoint:
``config.json`` + ``model.safetensors`` (random weights, fixed seed, via
``save_pretrained``), a byte-level BPE tokenizer built locally whose special
tokens sit at the ids the config names, a chat template, and the
image / video / audio processor settings. Those are written in the layout
transformers 5's ``ProcessorMixin.save_pretrained`` writes (one
``processor_config.json`` with ``image_processor`` / ``video_processor`` /
``feature_extractor`` blocks) unless ``processor_layout="legacy"`` asks for
the transformers 4 files most published checkpoints carry
(``preprocessor_config.json``, ``video_preprocessor_config.json``). Sizes follow transformers' own
model tests (hidden 32, 2 layers, 4 heads) but keep the real models'
structure: spatial merge 2, windowed vision attention, M-RoPE sections,
128 mel bins. The whole Qwen2.5-Omni model (talker, token2wav, speakers) is
written by ``tiny_omni_checkpoint.py`` on top of the thinker written here.
"""

from __future__ import annotations

import json
import os
from typing import Any, Literal

import torch

__all__ = [
    "OMNI_SPECIAL_TOKENS",
    "PROCESSOR_LAYOUTS",
    "VL_SPECIAL_TOKENS",
    "write_tiny_qwen2_5_omni_thinker",
    "write_tiny_qwen2_5_vl",
]

ProcessorLayout = Literal["nested", "legacy"]
PROCESSOR_LAYOUTS: tuple[ProcessorLayout, ...] = ("nested", "legacy")

_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
_PATCH, _MERGE, _TPS = 14, 2, 2
_UNIT = _PATCH * _MERGE  # one merged token covers a 28x28 pixel square

# Special tokens follow the byte vocabulary (ids 0..255) in this order.
VL_SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]  # fmt: skip
OMNI_SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>",
    "<|BOX_PAD|>", "<|QUAD_PAD|>", "<|vision_bos|>", "<|vision_eos|>", "<|vision_pad|>",
    "<|IMAGE|>", "<|VIDEO|>",
]  # fmt: skip
# 256 bytes + specials; ids 280..287 are reserved (no token string) for the
# full Omni checkpoint's talker text ids and speaker bos ids
# (tiny_omni_checkpoint.py), as the real vocabulary reserves such ids.
_VOCAB_SIZE = 288

_VL_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] in ('image', 'image_url') -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] in ('video', 'video_url') -%}{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
_OMNI_SYSTEM = (
    "You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of "
    "perceiving auditory and visual inputs, as well as generating text and speech."
)
_OMNI_TEMPLATE = (
    _VL_TEMPLATE.replace("You are a helpful assistant.", _OMNI_SYSTEM)
    .replace("<|vision_start|><|image_pad|><|vision_end|>", "<|vision_bos|><|IMAGE|><|vision_eos|>")
    .replace("<|vision_start|><|video_pad|><|vision_end|>", "<|vision_bos|><|VIDEO|><|vision_eos|>")
    .replace(
        "{%- elif part['type'] == 'text' -%}",
        "{%- elif part['type'] in ('audio', 'input_audio', 'audio_url') -%}"
        "{{- '<|audio_bos|><|AUDIO|><|audio_eos|>' -}}{%- elif part['type'] == 'text' -%}",
    )
)


def _byte_to_char() -> dict[int, str]:
    """The usual byte-level BPE alphabet: printable bytes map to themselves,
    the others to unused code points from 256 upwards."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _write_tokenizer(path: str, specials: list[str], named: dict[str, str], chat_template: str) -> dict[str, int]:
    """A byte-level BPE tokenizer without merges: every byte is one token,
    ``specials`` follow at ids 256.. Returns the special token ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: byte for byte, char in _byte_to_char().items()}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=named,
        model_max_length=32768,
        padding_side="left",
    )
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(path)
    ids = {s: backend.token_to_id(s) for s in specials}
    assert list(ids.values()) == list(range(256, 256 + len(specials)))
    return ids


def _write_json(path: str, name: str, data: dict[str, Any]) -> None:
    with open(os.path.join(path, name), "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)


def _check_layout(layout: str) -> None:
    if layout not in PROCESSOR_LAYOUTS:
        raise ValueError(f"processor_layout {layout!r}: expected one of {PROCESSOR_LAYOUTS}")


def _write_processor_settings(
    path: str, processor_class: str, blocks: dict[str, dict[str, Any]], layout: ProcessorLayout
) -> None:
    """Write the sub-processors' settings (``blocks`` keyed ``image_processor``,
    ``video_processor``, ``feature_extractor``) in ``layout``."""
    if layout == "nested":
        _write_json(path, "processor_config.json", {**blocks, "processor_class": processor_class})
        return
    # image processor and audio feature extractor share one file, as in the
    # published Qwen2.5-Omni checkpoint
    flat = {**blocks.get("feature_extractor", {}), **blocks["image_processor"], "processor_class": processor_class}
    _write_json(path, "preprocessor_config.json", flat)
    _write_json(path, "video_preprocessor_config.json", {**blocks["video_processor"], "processor_class": processor_class})


def _vision_processor_config(image_processor_type: str, min_tokens: int, max_tokens: int) -> dict[str, Any]:
    """Qwen2-VL image/video processor settings; the pixel limits are given in
    merged tokens (28x28 squares)."""
    min_pixels, max_pixels = min_tokens * _UNIT * _UNIT, max_tokens * _UNIT * _UNIT
    return {
        image_processor_type: "Qwen2VLImageProcessor" if "image" in image_processor_type else "Qwen2VLVideoProcessor",
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": _CLIP_MEAN,
        "image_std": _CLIP_STD,
        "max_pixels": max_pixels,
        "merge_size": _MERGE,
        "min_pixels": min_pixels,
        "patch_size": _PATCH,
        "resample": 3,
        "rescale_factor": 1 / 255,
        "size": {"longest_edge": max_pixels, "shortest_edge": min_pixels},
        "temporal_patch_size": _TPS,
    }


def _vision_config(**extra: Any) -> dict[str, Any]:
    return {
        "depth": 2,
        "hidden_size": 32,
        "out_hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 4,
        "in_channels": 3,
        "patch_size": _PATCH,
        "spatial_merge_size": _MERGE,
        "temporal_patch_size": _TPS,
        "window_size": 56,  # 2x2 merged tokens per attention window
        "fullatt_block_indexes": [1],
        **extra,
    }


def _text_config(mrope_section: list[int], eos: int, pad: int) -> dict[str, Any]:
    return {
        "vocab_size": _VOCAB_SIZE,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": mrope_section},
        "bos_token_id": pad,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "tie_word_embeddings": False,
    }


def _save_model(model: torch.nn.Module, path: str) -> None:
    model.eval()
    model.save_pretrained(path, safe_serialization=True)


def write_tiny_qwen2_5_vl(
    path: str | os.PathLike, seed: int = 0, processor_layout: ProcessorLayout = "nested"
) -> str:
    """A tiny ``Qwen2_5_VLForConditionalGeneration`` checkpoint. Images are
    resized to 4..64 merged tokens, video frames to 4..16 per frame pair;
    ``processor_layout`` picks the processor files (see the module docstring)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    _check_layout(processor_layout)
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    ids = _write_tokenizer(
        path,
        VL_SPECIAL_TOKENS,
        {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"},
        _VL_TEMPLATE,
    )
    eos, pad = ids["<|im_end|>"], ids["<|endoftext|>"]
    config = Qwen2_5_VLConfig(
        text_config=_text_config([2, 1, 1], eos, pad),
        vision_config=_vision_config(tokens_per_second=2),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        bos_token_id=pad,
        eos_token_id=eos,
        pad_token_id=pad,
        tie_word_embeddings=False,
    )
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32)
    _save_model(model, path)
    blocks = {
        "image_processor": _vision_processor_config("image_processor_type", 4, 64),
        "video_processor": _vision_processor_config("video_processor_type", 4, 16),
    }
    _write_processor_settings(path, "Qwen2_5_VLProcessor", blocks, processor_layout)
    return path


def _thinker_config(ids: dict[str, int]) -> Any:
    from transformers import Qwen2_5OmniThinkerConfig

    eos, pad = ids["<|im_end|>"], ids["<|endoftext|>"]
    return Qwen2_5OmniThinkerConfig(
        audio_config={
            "d_model": 32,
            "encoder_layers": 2,
            "encoder_attention_heads": 4,
            "encoder_ffn_dim": 64,
            "num_mel_bins": 128,
            "max_source_positions": 1500,
            "n_window": 100,
            "output_dim": 32,
        },
        vision_config=_vision_config(),
        text_config=_text_config([1, 1, 2], eos, pad),
        audio_token_index=ids["<|AUDIO|>"],
        image_token_index=ids["<|IMAGE|>"],
        video_token_index=ids["<|VIDEO|>"],
        audio_start_token_id=ids["<|audio_bos|>"],
        audio_end_token_id=ids["<|audio_eos|>"],
        vision_start_token_id=ids["<|vision_bos|>"],
        vision_end_token_id=ids["<|vision_eos|>"],
        user_token_id=ids["<|im_start|>"],
        position_id_per_seconds=25,
        seconds_per_chunk=2,
        pad_token_id=pad,
    )


def _write_omni_processor_files(path: str, layout: ProcessorLayout) -> dict[str, int]:
    from transformers import WhisperFeatureExtractor

    ids = _write_tokenizer(
        path,
        OMNI_SPECIAL_TOKENS,
        {
            "image_token": "<|IMAGE|>",
            "video_token": "<|VIDEO|>",
            "audio_token": "<|AUDIO|>",
            "vision_bos_token": "<|vision_bos|>",
            "vision_eos_token": "<|vision_eos|>",
            "audio_bos_token": "<|audio_bos|>",
            "audio_eos_token": "<|audio_eos|>",
        },
        _OMNI_TEMPLATE,
    )
    audio = WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, hop_length=160, chunk_length=30, n_fft=400)
    audio_dict = {k: v for k, v in audio.to_dict().items() if k != "mel_filters"}
    audio_dict["return_attention_mask"] = True
    blocks = {
        "feature_extractor": audio_dict,
        "image_processor": _vision_processor_config("image_processor_type", 4, 64),
        "video_processor": _vision_processor_config("video_processor_type", 4, 16),
    }
    _write_processor_settings(path, "Qwen2_5OmniProcessor", blocks, layout)
    return ids


def write_tiny_qwen2_5_omni_thinker(
    path: str | os.PathLike, seed: int = 0, processor_layout: ProcessorLayout = "nested"
) -> str:
    """A tiny ``Qwen2_5OmniThinkerForConditionalGeneration`` checkpoint
    (``model_type`` ``qwen2_5_omni_thinker``) with image, video and audio
    towers and the Qwen2.5-Omni processor files in ``processor_layout``."""
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration

    _check_layout(processor_layout)
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    ids = _write_omni_processor_files(path, processor_layout)
    config = _thinker_config(ids)
    config.architectures = ["Qwen2_5OmniThinkerForConditionalGeneration"]
    torch.manual_seed(seed)
    model = Qwen2_5OmniThinkerForConditionalGeneration(config).to(torch.float32)
    _save_model(model, path)
    return path
