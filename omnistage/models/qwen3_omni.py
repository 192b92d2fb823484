"""Qwen3-Omni: its checkpoint loaded, once, as the models its pipeline stages run.

- **thinker**: ``Qwen3OmniThinkerAdapter`` (MoE text stack on paged attention,
  audio tower through the encoder cache, M-RoPE), declaring the per-token rows
  its talker reads, so its stage keeps them in the tensor prefix cache;
- **talker**: ``PagedQwen3OmniTalker`` (MoE decoder with a shared expert on
  paged attention, inputs from each request's ``Qwen3TalkerState``, the code
  predictor run after sampling, declaring the frame codes as a deferred key);
- **code2wav**: ``Qwen3OmniCode2Wav`` (the causal vocoder, batched, with an
  exact chunked decode for streaming).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from omnistage.models.adapter import CausalLM
from omnistage.models.loader import (
    LoadedModel,
    checkpoint_config,
    eos_token_ids,
    hf_progress_bars_off,
    resolve_dtype,
)
from omnistage.models.mm_loader import TextStackView
from omnistage.models.qwen3_omni_code2wav import Qwen3OmniCode2Wav
from omnistage.models.qwen3_omni_talker import PagedQwen3OmniTalker, Qwen3TalkerPrep
from omnistage.models.qwen3_omni_thinker import Qwen3OmniThinkerAdapter

__all__ = [
    "QWEN3_OMNI_ARCHITECTURES",
    "Qwen3OmniModel",
    "is_qwen3_omni_checkpoint",
    "load_qwen3_omni",
]

QWEN3_OMNI_ARCHITECTURES = ("Qwen3OmniMoeForConditionalGeneration",)
DEFAULT_QWEN3_SPEAKER = "Ethan"  # transformers' generate() default


def is_qwen3_omni_checkpoint(model: str | Path | None) -> bool:
    """True for a whole Qwen3-Omni checkpoint folder (``config.json`` architectures or model_type)."""
    data = checkpoint_config(model)
    if data is None:
        return False
    architectures = set(data.get("architectures") or ())
    return (
        bool(architectures & set(QWEN3_OMNI_ARCHITECTURES))
        or data.get("model_type") == "qwen3_omni_moe"
    )


@dataclass
class Qwen3OmniModel:
    """The loaded stages of one Qwen3-Omni checkpoint; engines share its weights.

    ``speakers`` maps the voice names (as transformers spells them: case-insensitive,
    from ``talker_config.speaker_id``) to their codec ids. ``talker``, ``prep`` and
    ``code2wav`` are None for a checkpoint without audio output.
    """

    thinker: LoadedModel
    talker: PagedQwen3OmniTalker | None
    prep: Qwen3TalkerPrep | None
    code2wav: Qwen3OmniCode2Wav | None
    speakers: dict[str, int]
    config: Any

    @property
    def has_audio_output(self) -> bool:
        return (
            self.talker is not None
            and self.code2wav is not None
            and bool(self.speakers)
        )


def load_qwen3_omni(
    model: str | Path,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
) -> Qwen3OmniModel:
    """Load a ``Qwen3OmniMoeForConditionalGeneration`` folder."""
    from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration

    path = Path(model).expanduser()
    if not is_qwen3_omni_checkpoint(path):
        raise ValueError(
            f"{str(path)!r} is not a Qwen3-Omni checkpoint folder (config.json architectures)"
        )
    with hf_progress_bars_off():
        hf = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
            path, dtype=resolve_dtype(dtype)
        )
    hf.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = hf.config
    text_config = config.thinker_config.get_text_config()
    has_talker = bool(getattr(hf, "has_talker", False))
    accept = int(config.talker_config.accept_hidden_layer) if has_talker else None
    adapter = Qwen3OmniThinkerAdapter(hf.thinker, accept_hidden_layer=accept)
    thinker = LoadedModel(
        model=CausalLM(TextStackView(adapter.language_model, adapter.lm_head)),  # type: ignore[arg-type]
        tokenizer=tokenizer,
        hf_config=config,
        eos_token_ids=eos_token_ids(path, config.thinker_config, tokenizer),
        max_model_len=int(getattr(text_config, "max_position_embeddings", 2048)),
        model_path=str(path),
        name=path.resolve().name,
        mm_adapter=adapter,
    )
    if not has_talker:
        return Qwen3OmniModel(thinker, None, None, None, {}, config)
    speakers = {
        str(k): int(v) for k, v in (config.talker_config.speaker_id or {}).items()
    }
    prep = Qwen3TalkerPrep(hf, adapter)
    return Qwen3OmniModel(
        thinker=thinker,
        talker=PagedQwen3OmniTalker(hf.talker),
        prep=prep,
        code2wav=Qwen3OmniCode2Wav(hf.code2wav),
        speakers=speakers,
        config=config,
    )
