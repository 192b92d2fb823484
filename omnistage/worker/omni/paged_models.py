"""The Qwen2.5-Omni models as pipeline stages run them.

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
from typing import Any

import torch

from omnistage.models.adapter import CausalLM
from omnistage.models.qwen2_5_omni_thinker import Qwen2_5OmniThinkerAdapter
from omnistage.worker.attention import AttentionMetadata
from omnistage.worker.omni.tensor_cache_policy import NO_TENSOR_CACHE, TensorCachePolicy

__all__ = ["THINKER_FOR_TALKER_POLICY", "PagedOmniTalker", "ThinkerForTalkerAdapter"]

# The talker reads, for every token the thinker forwarded, final hidden + input embedding.
THINKER_FOR_TALKER_POLICY = TensorCachePolicy(full_prefix_hidden=True)


class ThinkerForTalkerAdapter(Qwen2_5OmniThinkerAdapter):
    """The Qwen2.5-Omni thinker adapter, as the first stage of an omni pipeline.

    It declares the one per-token tensor its talker reads for every token:
    final hidden + input embedding, of ``hidden_size`` width. Its stage then
    keeps that tensor beside the KV blocks, so a prefix hit still hands the
    talker every row.
    """

    tensor_cache_policy = THINKER_FOR_TALKER_POLICY


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
