"""A tiny, whole ``Qwen3OmniMoeForConditionalGeneration`` checkpoint for tests.

``write_tiny_qwen3_omni(path, seed)`` saves, offline, a folder that loads like
``Qwen/Qwen3-Omni-30B-A3B-Instruct``: thinker (MoE text model, audio and
vision towers), talker (MoE decoder with a shared expert, code predictor) and
code2wav, built with transformers' own config classes; the tokenizer with a
chat template; the processor settings (``processor_config.json``,
transformers-5 layout). The speakers live in the talker config
(``speaker_id``, name -> codec id), as in the published checkpoint.

Sizes keep every structural feature the stages depend on while
``generate`` runs in about a second on one CPU thread:

- MoE everywhere it is in the real model: 4 experts, top-2 (thinker:
  normalized top-k; talker: not normalized, plus the gated shared expert);
- ``accept_hidden_layer=1`` < the thinker's 2 layers, so the talker reads an
  intermediate layer, not the last one;
- the talker's codec vocabulary is 1024 + 64: ``generate`` suppresses the top
  1024 ids except codec EOS, so codes 0..63 are the speakable ones and every
  control id (pad, bos, think ids, speakers) sits in the suppressed range, as
  in the real layout;
- 4 code groups (the talker's code + 3 from the code predictor), and a
  code2wav with the real upsampling (1920 samples per frame at 24 kHz) and a
  sliding window of 4 frames, so streaming needs real left context;
- the role words ``system``, ``user``, ``assistant`` are single tokens (as in
  the Qwen vocabulary), so ``generate``'s role detection sees them;
- codec and code-predictor heads are widened (std 1.0) and the vocoder's
  convolutions use PyTorch's fan-in init, so greedy codes have margins far
  above float noise and the waveform is audible (not ~1e-8).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from omnistage.testing.tiny_mm_checkpoints import _write_json, _write_tokenizer

__all__ = ["QWEN3_OMNI_SAMPLE_RATE", "QWEN3_OMNI_SPEAKERS", "write_tiny_qwen3_omni"]

QWEN3_OMNI_SAMPLE_RATE = 24000
QWEN3_OMNI_SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|audio_start|>", "<|audio_end|>", "<|audio_pad|>",
    "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<tts_pad>", "<tts_text_bos>",
    "<tts_text_eod>", "system", "user", "assistant",
]  # fmt: skip
_CODEBOOK = 64
_CODEC_VOCAB = 1024 + _CODEBOOK
_CODEC = {
    "pad": 1064,
    "bos": 1065,
    "eos": 1066,
    "nothink": 1067,
    "think_bos": 1068,
    "think_eos": 1069,
}
QWEN3_OMNI_SPEAKERS = {"ethan": 1070, "chelsie": 1071}
_NUM_CODE_GROUPS = 4

_SYSTEM = "You are a helpful assistant."
_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\n" + _SYSTEM + "<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] in ('image', 'image_url') -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] in ('video', 'video_url') -%}{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] in ('audio', 'input_audio', 'audio_url') -%}"
    "{{- '<|audio_start|><|audio_pad|><|audio_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def _moe_text(vocab: int, **extra: Any) -> dict[str, Any]:
    return {
        "vocab_size": vocab,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "moe_intermediate_size": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1000000.0,
            "mrope_section": [2, 1, 1],
            "interleaved": True,
        },
        **extra,
    }


def _configs(ids: dict[str, int]) -> Any:
    from transformers import Qwen3OmniMoeConfig

    eos, pad = ids["<|im_end|>"], ids["<|endoftext|>"]
    mm_ids = {
        "audio_token_id": ids["<|audio_pad|>"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "audio_start_token_id": ids["<|audio_start|>"],
    }
    thinker = {
        "audio_config": {
            "num_mel_bins": 128,
            "encoder_layers": 2,
            "encoder_attention_heads": 4,
            "encoder_ffn_dim": 64,
            "d_model": 32,
            "output_dim": 32,
            "downsample_hidden_size": 16,
            "n_window": 50,
            "n_window_infer": 800,
        },
        "vision_config": {
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 4,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": 32,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [1],
        },
        "text_config": _moe_text(
            320,
            norm_topk_prob=True,
            bos_token_id=pad,
            eos_token_id=eos,
            pad_token_id=pad,
        ),
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "audio_end_token_id": ids["<|audio_end|>"],
        "user_token_id": ids["user"],
        "position_id_per_seconds": 25,
        "pad_token_id": pad,
        **mm_ids,
    }
    talker = {
        "text_config": _moe_text(
            _CODEC_VOCAB, norm_topk_prob=False, shared_expert_intermediate_size=32
        ),
        "code_predictor_config": {
            "vocab_size": _CODEBOOK,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "num_code_groups": _NUM_CODE_GROUPS,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        "num_code_groups": _NUM_CODE_GROUPS,
        "thinker_hidden_size": 32,
        "accept_hidden_layer": 1,
        "codec_eos_token_id": _CODEC["eos"],
        "codec_pad_id": _CODEC["pad"],
        "codec_bos_id": _CODEC["bos"],
        "codec_nothink_id": _CODEC["nothink"],
        "codec_think_bos_id": _CODEC["think_bos"],
        "codec_think_eos_id": _CODEC["think_eos"],
        "speaker_id": dict(QWEN3_OMNI_SPEAKERS),
        "vision_start_token_id": ids["<|vision_start|>"],
        "position_id_per_seconds": 25,
        "spatial_merge_size": 2,
        **mm_ids,
    }
    code2wav = {
        "codebook_size": _CODEBOOK,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "sliding_window": 4,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_quantizers": _NUM_CODE_GROUPS,
        "upsample_rates": [8, 5, 4, 3],
        "upsampling_ratios": [2, 2],
        "decoder_dim": 32,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }
    config = Qwen3OmniMoeConfig(
        thinker_config=thinker,
        talker_config=talker,
        code2wav_config=code2wav,
        enable_audio_output=True,
        im_start_token_id=ids["<|im_start|>"],
        im_end_token_id=eos,
        tts_pad_token_id=ids["<tts_pad>"],
        tts_bos_token_id=ids["<tts_text_bos>"],
        tts_eos_token_id=ids["<tts_text_eod>"],
        system_token_id=ids["system"],
        user_token_id=ids["user"],
        assistant_token_id=ids["assistant"],
    )
    config.architectures = ["Qwen3OmniMoeForConditionalGeneration"]
    return config


def _processor_blocks() -> dict[str, Any]:
    from transformers import WhisperFeatureExtractor

    audio = WhisperFeatureExtractor(
        feature_size=128,
        sampling_rate=16000,
        hop_length=160,
        chunk_length=30,
        n_fft=400,
    )
    audio_dict = {k: v for k, v in audio.to_dict().items() if k != "mel_filters"}
    audio_dict["return_attention_mask"] = True
    unit = 16 * 2  # one merged token covers a 32x32 pixel square

    def vision(kind: str, min_tokens: int, max_tokens: int) -> dict[str, Any]:
        lo, hi = min_tokens * unit * unit, max_tokens * unit * unit
        return {
            kind: "Qwen2VLImageProcessor"
            if kind == "image_processor_type"
            else "Qwen2VLVideoProcessor",
            "do_convert_rgb": True,
            "do_normalize": True,
            "do_rescale": True,
            "do_resize": True,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "merge_size": 2,
            "patch_size": 16,
            "resample": 3,
            "rescale_factor": 1 / 255,
            "size": {"longest_edge": hi, "shortest_edge": lo},
            "temporal_patch_size": 2,
        }

    return {
        "feature_extractor": audio_dict,
        "image_processor": vision("image_processor_type", 4, 64),
        "video_processor": vision("video_processor_type", 4, 16),
        "processor_class": "Qwen3OmniMoeProcessor",
    }


def write_tiny_qwen3_omni(path: str | os.PathLike, seed: int = 0) -> Path:
    """Write the tiny Qwen3-Omni checkpoint to ``path`` and return it."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    named = {
        "image_token": "<|image_pad|>",
        "video_token": "<|video_pad|>",
        "audio_token": "<|audio_pad|>",
        "vision_bos_token": "<|vision_start|>",
        "vision_eos_token": "<|vision_end|>",
        "audio_bos_token": "<|audio_start|>",
        "audio_eos_token": "<|audio_end|>",
    }
    ids = _write_tokenizer(os.fspath(path), QWEN3_OMNI_SPECIAL_TOKENS, named, _TEMPLATE)
    config = _configs(ids)
    torch.manual_seed(seed)
    model = Qwen3OmniMoeForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():
        # transformers leaves the talker's experts uninitialized (torch.empty): whatever
        # the allocator held, NaN included. Seeded values make the checkpoint a function of seed.
        generator = torch.Generator().manual_seed(seed + 1)
        for layer in model.talker.model.layers:
            for param in layer.mlp.experts.parameters():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
        # Wide heads: greedy codes are then a property of the model, not of kernel rounding.
        model.talker.codec_head.weight.normal_(0.0, 1.0)
        for head in model.talker.code_predictor.lm_head:
            head.weight.normal_(0.0, 1.0)
        # Fan-in init through the vocoder keeps |wave| ~ 0.1 after its upsampling stages.
        for module in model.code2wav.modules():
            if isinstance(module, (torch.nn.Conv1d, torch.nn.ConvTranspose1d)):
                module.reset_parameters()
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    _write_json(os.fspath(path), "processor_config.json", _processor_blocks())
    return path
