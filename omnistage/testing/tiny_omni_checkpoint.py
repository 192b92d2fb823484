"""A tiny, whole ``Qwen2_5OmniForConditionalGeneration`` checkpoint for tests.

``write_tiny_qwen2_5_omni(path, seed)`` saves, offline, a folder that loads
like ``Qwen/Qwen2.5-Omni-7B``: thinker, talker and token2wav (DiT + BigVGAN)
weights via ``save_pretrained``, ``spk_dict.pt`` with the speakers
"Chelsie" (the default of ``generate``) and "Ethan", and the tokenizer /
processor files.

The thinker, tokenizer and processor files come from
``tiny_mm_checkpoints.write_tiny_qwen2_5_omni_thinker`` with the same seed, so
the thinker of this checkpoint has exactly the weights of the thinker-only
checkpoint. Talker and token2wav are initialised from ``seed`` after that.

Sizes are chosen so that ``generate(..., return_audio=True)`` runs on a CPU in
about a second (single thread), while keeping every structural feature the
stages depend on:

- talker ``hidden_size`` (48) differs from the thinker hidden size (32) =
  talker ``embedding_size``, so a mix-up of ``thinker_to_talker_proj`` shows;
- codec ids follow the real layout (control ids at the top of the codec
  vocabulary: pad, start, end, mask), and the DiT embeds every codec id;
- BigVGAN upsamples by 5*3*2*2*2*2 = 240 samples per mel frame as the real
  vocoder does (2 mel frames per codec token -> 480 samples per token at
  24 kHz), with enough channels left after six halvings (64 -> 1);
- speaker ``bos_token`` ids and the talker's ``tts_text_*`` ids are thinker
  vocabulary ids without a token string, as in the real checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from omnistage.testing.tiny_mm_checkpoints import ProcessorLayout, write_tiny_qwen2_5_omni_thinker

__all__ = [
    "CODEC_VOCAB_SIZE",
    "SAMPLE_RATE",
    "SPEAKER_BOS_TOKEN_IDS",
    "TALKER_EOS_TOKEN_IDS",
    "write_tiny_qwen2_5_omni",
]

SAMPLE_RATE = 24000
CODEC_VOCAB_SIZE = 64
# codec control ids, in the order of the real checkpoint (8292..8296)
_CODEC_PAD, _CODEC_START, _CODEC_END, _CODEC_MASK = 60, 61, 62, 63
# What ``generate``'s default ``talker_eos_token_id=[8292, 8294]`` means for
# this checkpoint: codec pad and codec end.
TALKER_EOS_TOKEN_IDS = [_CODEC_PAD, _CODEC_END]
# Reserved thinker ids 280..287 have no token string (vocabulary 288).
_TTS_TEXT_PAD, _TTS_TEXT_START, _TTS_TEXT_END = 280, 281, 282
SPEAKER_BOS_TOKEN_IDS = {"Chelsie": 283, "Ethan": 284}
_REF_MEL_FRAMES = 30


def _talker_config(thinker: Any) -> dict[str, Any]:
    return {
        "vocab_size": CODEC_VOCAB_SIZE,
        "embedding_size": thinker.text_config.hidden_size,
        "hidden_size": 48,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [1, 1, 2]},
        "spatial_merge_size": thinker.vision_config.spatial_merge_size,
        "position_id_per_seconds": thinker.position_id_per_seconds,
        "seconds_per_chunk": thinker.seconds_per_chunk,
        "audio_token_index": thinker.audio_token_index,
        "image_token_index": thinker.image_token_index,
        "video_token_index": thinker.video_token_index,
        "vision_start_token_id": thinker.vision_start_token_id,
        "vision_end_token_id": getattr(thinker, "vision_end_token_id", None),
        "audio_start_token_id": thinker.audio_start_token_id,
        "audio_end_token_id": thinker.audio_end_token_id,
        "tts_codec_start_token_id": _CODEC_START,
        "tts_codec_end_token_id": _CODEC_END,
        "tts_codec_pad_token_id": _CODEC_PAD,
        "tts_codec_mask_token_id": _CODEC_MASK,
        "tts_text_start_token_id": _TTS_TEXT_START,
        "tts_text_end_token_id": _TTS_TEXT_END,
        "tts_text_pad_token_id": _TTS_TEXT_PAD,
    }


_TOKEN2WAV_CONFIG: dict[str, Any] = {
    "dit_config": {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "head_dim": 16,
        "ff_mult": 2,
        "emb_dim": 16,
        "num_embeds": CODEC_VOCAB_SIZE,  # codec_embed has num_embeds + 1 rows
        "mel_dim": 80,
        "enc_emb_dim": 32,  # speaker "cond" width
        "enc_dim": 16,
        "enc_channels": [32, 32, 32, 32, 96],  # last = 3 * 32: the aggregation concatenates blocks 1..3
        "enc_kernel_sizes": [5, 3, 3, 3, 1],
        "enc_dilations": [1, 2, 3, 4, 1],
        "enc_attention_channels": 16,
        "enc_res2net_scale": 2,
        "enc_se_channels": 16,
        "block_size": 4,  # several DiT attention blocks even for short code sequences
        "look_ahead_layers": [1],
        "look_backward_layers": [0],
        "repeats": 2,
    },
    "bigvgan_config": {
        "mel_dim": 80,
        "upsample_initial_channel": 64,  # 64 // 2**6 = 1 channel before conv_post
        "resblock_kernel_sizes": [3],
        "resblock_dilation_sizes": [[1, 3, 5]],
        "upsample_rates": [5, 3, 2, 2, 2, 2],
        "upsample_kernel_sizes": [11, 7, 4, 4, 4, 4],
    },
}


def write_tiny_qwen2_5_omni(
    path: str | os.PathLike, seed: int = 0, processor_layout: ProcessorLayout = "nested"
) -> Path:
    """Write the tiny Qwen2.5-Omni checkpoint to ``path`` and return it
    (``processor_layout``: see ``tiny_mm_checkpoints``)."""
    from transformers import (
        Qwen2_5OmniConfig,
        Qwen2_5OmniForConditionalGeneration,
        Qwen2_5OmniThinkerConfig,
        Qwen2_5OmniThinkerForConditionalGeneration,
    )

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    write_tiny_qwen2_5_omni_thinker(path, seed=seed, processor_layout=processor_layout)  # tokenizer, processor files, thinker weights
    thinker_config = Qwen2_5OmniThinkerConfig.from_pretrained(path)
    thinker_state = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(path).state_dict()

    config = Qwen2_5OmniConfig(
        thinker_config=thinker_config.to_dict(),
        talker_config=_talker_config(thinker_config),
        token2wav_config=_TOKEN2WAV_CONFIG,
        enable_audio_output=True,
    )
    config.architectures = ["Qwen2_5OmniForConditionalGeneration"]
    torch.manual_seed(seed)
    model = Qwen2_5OmniForConditionalGeneration(config).to(torch.float32)
    # transformers' init (normal, std 0.02) shrinks the signal through BigVGAN's
    # six upsampling stages to ~1e-8; PyTorch's fan-in init keeps it audible
    # (|wave| ~ 0.1), so waveform comparisons in tests mean something.
    for module in model.token2wav.code2wav_bigvgan_model.modules():
        if isinstance(module, (torch.nn.Conv1d, torch.nn.ConvTranspose1d)):
            module.reset_parameters()
    # With transformers' init the codec logits differ by ~1e-2 between the
    # best two codes, so any change in float rounding (a paged-attention kernel,
    # a different batch) flips greedy choices; a wider codec head makes greedy
    # codes a property of the model rather than of the kernels.
    with torch.no_grad():
        model.talker.codec_head.weight.normal_(0.0, 1.0)
    model.thinker.load_state_dict(thinker_state)
    model.eval()
    # Overwrites the thinker-only config.json / model.safetensors.
    model.save_pretrained(path, safe_serialization=True)

    dit = _TOKEN2WAV_CONFIG["dit_config"]
    generator = torch.Generator().manual_seed(seed + 1)
    speakers = {
        name: {
            "cond": torch.randn(dit["enc_emb_dim"], generator=generator),
            "ref_mel": torch.randn(1, _REF_MEL_FRAMES, dit["mel_dim"], generator=generator),
            "bos_token": bos,  # a thinker text id: the talker's text stream starts with it
        }
        for name, bos in SPEAKER_BOS_TOKEN_IDS.items()
    }
    torch.save(speakers, path / "spk_dict.pt")
    return path
