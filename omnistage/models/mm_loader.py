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
    """A decoder stack and its head inside a bigger model (a multimodal model's
    language model, an omni talker's decoder and codec head), shaped like the
    HF causal LM that ``CausalLM`` wraps (``model``, ``config``, embeddings).

    ``set_attn_implementation`` reaches this decoder only: the towers' (or the
    code predictor's) configs are separate objects and keep their attention."""

    def __init__(self, model: torch.nn.Module, head: torch.nn.Module) -> None:
        self.model = model
        self.config = model.config  # the stack's own config; get_text_config() returns itself
        self._lm_head = head

    def eval(self) -> TextStackView:
        self.model.eval()
        return self

    def set_attn_implementation(self, impl: str) -> None:
        self.model.set_attn_implementation(impl)

    def get_decoder(self) -> torch.nn.Module:
        return self.model

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.get_input_embeddings()

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
    return CausalLM(TextStackView(adapter.language_model, adapter.lm_head)), adapter  # type: ignore[arg-type]


# Where a checkpoint may keep a tower's weights: the legacy layout at the top
# level, transformers 5's under ``model.``, a whole Omni checkpoint under ``thinker.``.
_TOWER_PREFIXES = ("", "model.", "thinker.", "thinker.model.")
TOWER_NAMES = ("visual", "audio_tower")


def load_mm_encoder(path: Path, dtype: torch.dtype, device: str | torch.device) -> QwenMultiModalAdapter:
    """The adapter of a multimodal checkpoint with its vision / audio towers
    only, for an encoder-only worker: the language model and the LM head are
    built on the meta device (no memory, no weights read), the towers are
    built as transformers builds them and get their weights from the
    checkpoint's safetensors. ``embed_multimodal`` then computes exactly what
    the whole model's adapter computes; nothing else may be called."""
    import glob

    from safetensors import safe_open
    from transformers import (
        AutoConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5OmniThinkerForConditionalGeneration,
    )

    from omnistage.models.qwen2_5_omni_thinker import Qwen2_5OmniThinkerAdapter
    from omnistage.models.qwen2_5_vl import Qwen2_5_VLAdapter

    config = AutoConfig.from_pretrained(path)
    if config.model_type == "qwen2_5_vl":
        cls: Any = Qwen2_5_VLForConditionalGeneration
        adapter_cls: type[QwenMultiModalAdapter] = Qwen2_5_VLAdapter
    elif config.model_type in ("qwen2_5_omni", "qwen2_5_omni_thinker"):
        config = config.thinker_config if config.model_type == "qwen2_5_omni" else config
        cls, adapter_cls = Qwen2_5OmniThinkerForConditionalGeneration, Qwen2_5OmniThinkerAdapter
    else:
        raise ValueError(
            f"{str(path)!r}: model_type {config.model_type!r} is not multimodal; expected one of {MM_MODEL_TYPES}"
        )
    with torch.device("meta"):
        hf: Any = cls._from_config(config, dtype=dtype)
    towers: dict[str, torch.nn.Module] = {}
    for name in TOWER_NAMES:
        skeleton = getattr(hf.model, name, None)
        if skeleton is not None:
            towers[name] = type(skeleton)._from_config(skeleton.config, dtype=dtype)
    state: dict[str, dict[str, torch.Tensor]] = {name: {} for name in towers}
    for file in sorted(glob.glob(str(Path(path) / "*.safetensors"))):
        with safe_open(file, "pt") as f:
            for key in f.keys():
                for name in towers:
                    prefix = next((p for p in _TOWER_PREFIXES if key.startswith(f"{p}{name}.")), None)
                    if prefix is not None:
                        state[name][key[len(prefix) + len(name) + 1 :]] = f.get_tensor(key)
    for name, tower in towers.items():
        result = tower.load_state_dict(state[name], strict=False)
        persistent = set(tower.state_dict())
        missing = [k for k in result.missing_keys if k in persistent]
        if missing or result.unexpected_keys:
            raise ValueError(
                f"{str(path)!r}: the {name} weights do not match the tower: missing {missing[:5]}, "
                f"unexpected {result.unexpected_keys[:5]}"
            )
        setattr(hf.model, name, tower.to(device=device, dtype=dtype).eval())
    return adapter_cls(hf)
