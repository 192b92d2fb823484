"""Helpers for the multimodal engine tests: tiny checkpoints whose answers
depend on the media, media makers, and transformers' greedy ``generate``."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from PIL import Image

from omnistage.multimodal.processing import MultiModalProcessor, ProcessedPrompt
from omnistage.testing.hf_reference import hf_reference_inputs
from omnistage.testing.tiny_mm_checkpoints import write_tiny_qwen2_5_omni_thinker, write_tiny_qwen2_5_vl


def write_sensitive_checkpoint(kind: str, path: str | os.PathLike, gain: float = 2.0) -> str:
    """The tiny ``vl`` / ``omni`` (thinker) checkpoint with every weight
    matrix redrawn at std ``gain / sqrt(fan_in)`` (fixed seed).

    With transformers' default init (std 0.02) the tiny models answer the
    same tokens whatever the image or clip: attention averages the media away.
    Redrawn weights make the greedy answer depend on every item, so an
    equality test fails if an item's rows are lost, misplaced or swapped."""
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2_5OmniThinkerForConditionalGeneration

    writer, cls = {
        "vl": (write_tiny_qwen2_5_vl, Qwen2_5_VLForConditionalGeneration),
        "omni": (write_tiny_qwen2_5_omni_thinker, Qwen2_5OmniThinkerForConditionalGeneration),
    }[kind]
    path = writer(path)
    model = cls.from_pretrained(path).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2 and "embed_positions" not in name:  # keep the audio tower's sinusoids
                p.copy_(torch.randn(p.shape, generator=gen) * gain / p[0].numel() ** 0.5)
    model.save_pretrained(path)
    return path


def image(seed: int, h: int = 60, w: int = 90) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def video(seed: int, t: int = 3, h: int = 56, w: int = 84) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (t, h, w, 3), dtype=np.uint8)


def clip(seed: int, seconds: float) -> tuple[np.ndarray, int]:
    return (np.random.default_rng(seed).standard_normal(int(16000 * seconds)) * 0.1).astype(np.float32), 16000


def chat_prompt(proc: MultiModalProcessor, parts: list[str], data: dict, text: str = "what is this?") -> dict:
    """A vLLM-style prompt dict: the chat template over ``parts`` (modality
    names or "text") plus ``multi_modal_data``."""
    content = [{"type": p} if p != "text" else {"type": "text", "text": text} for p in parts]
    return {"prompt": proc.apply_chat_template([{"role": "user", "content": content}]), "multi_modal_data": data}


def hf_greedy_mm(model: Any, out: ProcessedPrompt, max_new_tokens: int) -> list[int]:
    """transformers' own ``generate`` (greedy, no EOS stop) on a processed prompt."""
    ids = torch.tensor([out.prompt_token_ids])
    kwargs = hf_reference_inputs(model, out, ids)
    with torch.no_grad():
        seq = model.generate(
            **kwargs,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return seq[0, ids.shape[1] :].tolist()
