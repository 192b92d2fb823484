"""Qwen2.5-Omni: its checkpoint loaded as the models its pipeline stages run.

- The thinker is the multimodal thinker adapter, plus its declaration of the
  per-token tensor the talker needs in full. Because of that declaration its
  stage builds a tensor prefix cache.
- The talker is ``CausalLM`` over HF's talker (decoder layers on
  ``ATTN_IMPL``). Its inputs have the thinker's width and are projected by
  ``thinker_to_talker_proj`` before the decoder. Its logits come from
  ``codec_head``. It declares no cached tensors: nothing downstream reads its
  hidden states.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omnistage.attention.paged_attention import AttentionMetadata, StepLayout
from omnistage.models.adapter import CausalLM
from omnistage.models.interface import NO_TENSOR_CACHE, TensorCachePolicy
from omnistage.models.loader import LoadedModel, checkpoint_config, eos_token_ids, hf_progress_bars_off, resolve_dtype
from omnistage.models.mm_loader import TextStackView
from omnistage.models.qwen2_5_omni_talker import TalkerPrompt, thinker_states_for_talker
from omnistage.models.qwen2_5_omni_thinker import Qwen2_5OmniThinkerAdapter
from omnistage.models.qwen2_5_omni_token2wav import Qwen2_5OmniToken2Wav

__all__ = [
    "OMNI_ARCHITECTURES",
    "THINKER_FOR_TALKER_POLICY",
    "OmniModel",
    "PagedOmniTalker",
    "ThinkerForTalkerAdapter",
    "is_omni_checkpoint",
    "load_qwen2_5_omni",
]

# The talker reads, for every token the thinker forwarded, final hidden + input embedding.
THINKER_FOR_TALKER_POLICY = TensorCachePolicy(full_prefix_hidden=True)


class ThinkerForTalkerAdapter(Qwen2_5OmniThinkerAdapter):
    """The Qwen2.5-Omni thinker adapter, as the first stage of an omni pipeline.

    It declares the one per-token tensor its talker reads for every token:
    final hidden + input embedding, of ``hidden_size`` width, with the
    embedding zero at multimodal placeholders (``thinker_states_for_talker``).
    Its stage then keeps that tensor beside the KV blocks, so a prefix hit
    still hands the talker every row.
    """

    tensor_cache_policy = THINKER_FOR_TALKER_POLICY

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        names = ("audio_token_index", "image_token_index", "video_token_index")
        ids = [int(getattr(self.config, n)) for n in names if getattr(self.config, n, None) is not None]
        self._placeholders = torch.tensor(ids, device=self.device)

    @torch.inference_mode()
    def per_token_outputs(self, hidden: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` rows the talker conditions on, for a step's packed tokens."""
        return thinker_states_for_talker(
            hidden, self.embed_input_ids(input_ids), torch.isin(input_ids, self._placeholders)
        )


class PagedOmniTalker:
    """``Qwen2_5OmniTalkerForConditionalGeneration`` on paged attention.

    ``forward`` takes ``inputs_embeds`` of the *thinker's* width (the talker
    stage builds them: prefill rows, or codec embedding + thinker reply row) and
    3-axis M-RoPE ``positions`` ``[3, T]``.
    """

    tensor_cache_policy = NO_TENSOR_CACHE

    def __init__(self, talker: Any) -> None:
        self._lm = CausalLM(talker)  # switches the talker's attention to ATTN_IMPL, in place
        self._proj = talker.thinker_to_talker_proj
        self._codec_head = talker.codec_head
        self._codec_embed = talker.get_input_embeddings()
        self.num_layers = self._lm.num_layers
        self.num_kv_heads = self._lm.num_kv_heads
        self.head_dim = self._lm.head_dim
        self.hidden_size = self._lm.hidden_size
        self.vocab_size = self._lm.vocab_size

    @property
    def dtype(self) -> torch.dtype:
        return self._proj.weight.dtype

    @property
    def device(self) -> torch.device:
        return self._proj.weight.device

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_caches: Sequence[torch.Tensor],
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if inputs_embeds is None:
            raise ValueError("PagedOmniTalker.forward: the talker runs on inputs_embeds (thinker width), got none")
        return self._lm.forward(input_ids, positions, attn_metadata, kv_caches, inputs_embeds=self._proj(inputs_embeds))

    __call__ = forward

    @torch.inference_mode()
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self._codec_head(hidden_states).float()

    @torch.inference_mode()
    def embed_codec(self, codec_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` codec ids -> ``[T, thinker_hidden]`` codec embeddings."""
        return self._codec_embed(codec_ids)

    @torch.inference_mode()
    def step_inputs(self, step: StepLayout, prompts: Sequence[TalkerPrompt]) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, thinker_hidden]`` inputs (before projection) and ``[3, T]`` positions.

        A request's token at index ``i`` enters as follows (``P`` prompt rows,
        ``R`` reply rows, in its ``TalkerPrompt``):

        - ``i < P``: ``prompt.prefill_embeds[i]`` at ``prompt.positions[:, i]``;
        - ``i >= P``: ``codec_embed(token i) + reply[min(i - P, R - 1)]`` at
          ``i + rope_delta`` on all three axes (token ``i`` is the code
          sampled at ``i - 1``; past the reply its last row, tts_text_pad,
          repeats).

        Both branches are taken per request, so chunked prefill and mixed
        prefill/decode steps work as for text.
        """
        rows: list[torch.Tensor] = []
        positions: list[torch.Tensor] = []
        is_code = np.zeros(step.num_tokens, dtype=bool)
        starts = step.num_computed_tokens.tolist()
        ends = step.seq_lens.tolist()
        offsets = step.query_start_loc.tolist()
        # One pass per request: each contributes a slice of its prefill rows and/or
        # its reply rows; a single cat below copies them into the step's input.
        for prompt, start, end, offset in zip(prompts, starts, ends, offsets):
            num_prompt = prompt.num_prompt_tokens
            if start < num_prompt:
                stop = min(end, num_prompt)
                rows.append(prompt.prefill_embeds[start:stop])
                positions.append(prompt.positions[:, start:stop])
            if end > num_prompt:
                first = max(start, num_prompt)
                last_reply = prompt.reply.shape[0] - 1
                lo, hi = first - num_prompt, end - num_prompt
                if hi - 1 <= last_reply:
                    rows.append(prompt.reply[lo:hi])
                else:
                    rows.append(prompt.reply[torch.arange(lo, hi).clamp_(max=last_reply)])
                idx = torch.arange(first, end, device=prompt.positions.device) + prompt.rope_delta
                positions.append(idx.to(prompt.positions.dtype).expand(3, -1))
                is_code[offset + first - start : offset + end - start] = True
        x = torch.cat(rows) if len(rows) > 1 else rows[0]
        pos = torch.cat(positions, dim=1) if len(positions) > 1 else positions[0]
        if is_code.any():
            mask = torch.from_numpy(is_code).to(x.device)
            # codec_embed(code) + reply row, as the reference adds them (one lookup for the step).
            x = torch.where(mask[:, None], self.embed_codec(step.input_ids[: step.num_tokens]) + x, x)
        return x, pos

OMNI_ARCHITECTURES = ("Qwen2_5OmniForConditionalGeneration", "Qwen3OmniMoeForConditionalGeneration")
_OMNI_MODEL_TYPES = ("qwen2_5_omni", "qwen3_omni_moe")


def is_omni_checkpoint(model: str | Path | None) -> bool:
    """True for a checkpoint folder of a whole omni model (thinker + talker + vocoder):
    Qwen2.5-Omni or Qwen3-Omni (``load_qwen3_omni`` loads the latter)."""
    data = checkpoint_config(model)
    if data is None:
        return False
    architectures = set(data.get("architectures") or ())
    return bool(architectures & set(OMNI_ARCHITECTURES)) or data.get("model_type") in _OMNI_MODEL_TYPES


@dataclass
class OmniModel:
    """The loaded stages of one checkpoint. Engines share it: each owns only its KV caches.

    ``talker_module`` is HF's talker, with its attention switched to paged
    attention by ``paged_talker``. ``talker_text_rows`` are the few thinker
    embedding rows the talker needs (speaker bos ids, ``tts_text_end``,
    ``tts_text_pad``). ``talker``, ``paged_talker`` and ``token2wav`` are None
    for a checkpoint without audio output.
    """

    thinker: LoadedModel
    talker_module: Any | None
    talker_text_rows: dict[int, torch.Tensor]
    paged_talker: PagedOmniTalker | None
    token2wav: Qwen2_5OmniToken2Wav | None
    speakers: dict[str, dict[str, Any]]

    @property
    def has_audio_output(self) -> bool:
        return self.paged_talker is not None and self.token2wav is not None and bool(self.speakers)


def load_qwen2_5_omni(
    model: str | Path, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu"
) -> OmniModel:
    """Load a ``Qwen2_5OmniForConditionalGeneration`` folder (with ``spk_dict.pt`` for audio)."""
    from transformers import AutoTokenizer, Qwen2_5OmniForConditionalGeneration

    path = Path(model).expanduser()
    if not is_omni_checkpoint(path) or (checkpoint_config(path) or {}).get("model_type") != "qwen2_5_omni":
        raise ValueError(f"{str(path)!r} is not a Qwen2.5-Omni checkpoint folder (config.json architectures)")
    with hf_progress_bars_off():
        hf = Qwen2_5OmniForConditionalGeneration.from_pretrained(path, dtype=resolve_dtype(dtype))
    hf.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    text_config = hf.config.thinker_config.get_text_config()
    # One load for all stages: the thinker runs as the multimodal loader builds it
    # (text stack on paged attention, towers as transformers runs them).
    adapter = ThinkerForTalkerAdapter(hf.thinker)
    thinker = LoadedModel(
        model=CausalLM(TextStackView(adapter.language_model, adapter.lm_head)),  # type: ignore[arg-type]
        tokenizer=tokenizer,
        hf_config=hf.config,
        eos_token_ids=eos_token_ids(path, hf.config.thinker_config, tokenizer),
        max_model_len=int(getattr(text_config, "max_position_embeddings", 2048)),
        model_path=str(path),
        name=path.resolve().name,
        mm_adapter=adapter,
    )
    speakers = dict(getattr(hf, "speaker_map", {}) or {})
    if not getattr(hf, "has_talker", False):
        return OmniModel(thinker, None, {}, None, None, speakers)
    ids = {int(p["bos_token"]) for p in speakers.values()}
    ids |= {int(hf.talker.config.tts_text_end_token_id), int(hf.talker.config.tts_text_pad_token_id)}
    table = hf.thinker.get_input_embeddings()
    with torch.no_grad():
        rows = {i: table(torch.tensor([i], device=table.weight.device))[0].clone() for i in sorted(ids)}
    return OmniModel(
        thinker=thinker,
        talker_module=hf.talker,
        talker_text_rows=rows,
        paged_talker=PagedOmniTalker(hf.talker),
        token2wav=Qwen2_5OmniToken2Wav(hf.token2wav, speakers),
        speakers=speakers,
    )
