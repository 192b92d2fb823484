"""Load a multimodal checkpoint: the text stack on paged attention, the towers as transformers runs them.

Qwen2.5-VL (``qwen2_5_vl``) and the Qwen2.5-Omni thinker
(``qwen2_5_omni_thinker``) load as themselves; a whole Qwen2.5-Omni
checkpoint (``qwen2_5_omni``) loads its thinker only (talker and token2wav
belong to the Omni pipeline's later stages).

Only the language model switches to omnistage's paged attention: the vision
and audio towers keep transformers' own attention, so their outputs are what
transformers computes. ``CausalLM`` then runs over the language model through
``TextStackView``, which shows it the parts of a ``*ForCausalLM`` it uses.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig

from omnistage.models.adapter import CausalLM
from omnistage.models.mm_adapter import QwenMultiModalAdapter

MM_MODEL_TYPES = ("qwen2_5_vl", "qwen2_5_omni", "qwen2_5_omni_thinker")


class TextStackView:
    """A multimodal model's language model and LM head, shaped like the HF
    causal LM that ``CausalLM`` wraps (``model``, ``config``, embeddings).

    ``set_attn_implementation`` reaches the language model only: the towers'
    configs are separate objects and keep their attention."""

    def __init__(self, adapter: QwenMultiModalAdapter) -> None:
        self.model = adapter.language_model
        self.config = adapter.language_model.config  # the text config; get_text_config() returns itself
        self._lm_head = adapter.lm_head

    def eval(self) -> TextStackView:
        self.model.eval()
        return self

    def set_attn_implementation(self, impl: str) -> None:
        self.model.set_attn_implementation(impl)

    def get_decoder(self) -> torch.nn.Module:
        return self.model

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> torch.nn.Module:
        return self._lm_head


def mm_text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The language model's config of a multimodal checkpoint's config."""
    if config.model_type == "qwen2_5_omni":
        config = config.thinker_config
    return config.get_text_config()


def load_multimodal(
    path: Path, config: PretrainedConfig, dtype: torch.dtype, device: str | torch.device
) -> tuple[CausalLM, QwenMultiModalAdapter]:
    """``(CausalLM over the text stack, adapter over the whole model)``."""
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2_5OmniThinkerForConditionalGeneration

    from omnistage.models.qwen2_5_omni_thinker import Qwen2_5OmniThinkerAdapter
    from omnistage.models.qwen2_5_vl import Qwen2_5_VLAdapter

    model_type = config.model_type
    adapter: QwenMultiModalAdapter
    if model_type == "qwen2_5_vl":
        hf: Any = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=dtype)
        adapter_cls: type[QwenMultiModalAdapter] = Qwen2_5_VLAdapter
    elif model_type in ("qwen2_5_omni", "qwen2_5_omni_thinker"):
        # A whole Omni checkpoint stores the thinker under "thinker."; loading
        # the thinker class with the thinker config picks those weights only.
        thinker_config = config.thinker_config if model_type == "qwen2_5_omni" else config
        hf = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(path, config=thinker_config, dtype=dtype)
        adapter_cls = Qwen2_5OmniThinkerAdapter
    else:
        raise ValueError(
            f"{str(path)!r}: model_type {model_type!r} is not multimodal; expected one of {MM_MODEL_TYPES}"
        )
    hf.to(device).eval()
    adapter = adapter_cls(hf)
    return CausalLM(TextStackView(adapter)), adapter  # type: ignore[arg-type]
