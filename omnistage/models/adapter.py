"""The engine's view of a Hugging Face ``*ForCausalLM``.

For Llama, Qwen2 and Qwen3 a lean forward
(:mod:`omnistage.models.fast_forward`) runs the decoder math with far fewer
ops per layer, over the HF modules' weights or, for GGUF-quantized ones,
over their exact group-int8 form alone (the HF copies released, and rebuilt
before anything runs the HF modules); any other model runs HF's own modules
with their attention function swapped for omnistage's paged one
(:data:`~omnistage.attention.paged_attention.ATTN_IMPL`), on a step's packed tokens as
a batch of one. The LM head is kept apart so the runner computes logits only
for the tokens it samples.

``OMNISTAGE_LEAN_FORWARD=0`` in the environment (read when a model is
wrapped) or ``CausalLM.use_lean = False`` selects the HF modeling path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PretrainedConfig, PreTrainedModel

from omnistage import envs
from omnistage.models.fast_forward import LeanDecoder, lean_decoder_or_none
from omnistage.attention.paged_attention import ATTN_IMPL, AttentionMetadata, attention_context
from omnistage.kernels.argmax import first_argmax

LEAN_ENV = envs.LEAN_FORWARD.name


class CausalLM:
    """A decoder-only HF model running over omnistage's paged KV cache.

    Construction switches ``hf_model`` to ``ATTN_IMPL`` in place and puts it
    in eval mode; afterwards the HF model only runs inside
    :meth:`forward` (it needs the step's attention context).
    """

    def __init__(self, hf_model: PreTrainedModel, lean: bool | None = None) -> None:
        hf_model.eval()
        hf_model.set_attn_implementation(ATTN_IMPL)
        if hf_model.config._attn_implementation != ATTN_IMPL:
            raise ValueError(
                f"{type(hf_model).__name__} did not accept attention implementation {ATTN_IMPL!r} "
                f"(it kept {hf_model.config._attn_implementation!r}); its attention layers do not use "
                "transformers' AttentionInterface"
            )
        self._hf = hf_model
        self._base = getattr(hf_model, "model", None) or hf_model.get_decoder()
        self._embed = hf_model.get_input_embeddings()
        self._lm_head = hf_model.get_output_embeddings()
        text = self.text_config
        self._num_layers = int(text.num_hidden_layers)
        num_heads = int(text.num_attention_heads)
        self._num_kv_heads = int(getattr(text, "num_key_value_heads", None) or num_heads)
        self._head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // num_heads)
        self._hidden_size = int(text.hidden_size)
        self._vocab_size = int(text.vocab_size)
        if lean is None:
            lean = envs.lean_forward_enabled()
        self._lean: LeanDecoder | None = lean_decoder_or_none(hf_model) if lean else None
        self._use_lean = self._lean is not None

    @property
    def use_lean(self) -> bool:
        """Whether steps run the lean forward; set ``False`` (any time) for the HF modules."""
        return self._use_lean

    @use_lean.setter
    def use_lean(self, value: bool) -> None:
        if not value:
            self._hf_weights()
        self._use_lean = bool(value) and self._lean is not None

    def _hf_weights(self) -> None:
        """Make sure the HF modules hold their weights (the lean forward may have released them)."""
        if self._lean is not None and not self._lean.holds_hf_weights:
            self._lean.restore_hf_weights()

    @property
    def lean(self) -> LeanDecoder | None:
        """The lean decoder when the model qualifies (see :mod:`omnistage.models.fast_forward`)."""
        return self._lean

    @property
    def hf_model(self) -> PreTrainedModel:
        """The HF model, with its weights (rebuilt first if the lean forward had released them)."""
        self._hf_weights()
        return self._hf

    @property
    def text_config(self) -> PretrainedConfig:
        return self._hf.config.get_text_config()

    @property
    def num_layers(self) -> int:
        return self._num_layers

    @property
    def num_kv_heads(self) -> int:
        return self._num_kv_heads

    @property
    def head_dim(self) -> int:
        return self._head_dim

    @property
    def hidden_size(self) -> int:
        return self._hidden_size

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def dtype(self) -> torch.dtype:
        return self._embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self._embed.weight.device

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_caches: Sequence[torch.Tensor],
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final-norm hidden states ``[T, hidden]`` of a step's packed tokens.

        ``input_ids`` is ``[T]``; ``positions`` is ``[T]``, or ``[3, T]`` for
        M-RoPE models. Pass ``inputs_embeds`` ``[T, hidden]`` instead of ids
        when multimodal embeddings were merged in (``input_ids`` is then
        ignored).
        """
        if len(kv_caches) != self._num_layers:
            raise ValueError(f"got {len(kv_caches)} KV caches for a model with {self._num_layers} layers")
        if self._use_lean and positions.dim() == 1:
            return self._lean.forward(input_ids, positions, attn_metadata, kv_caches, inputs_embeds)
        self._hf_weights()
        position_ids = positions[None] if positions.dim() == 1 else positions[:, None]  # batch dim of one
        with attention_context(attn_metadata, kv_caches):
            if inputs_embeds is not None:
                out = self._base(inputs_embeds=inputs_embeds[None], position_ids=position_ids, use_cache=False)
            else:
                out = self._base(input_ids=input_ids[None], position_ids=position_ids, use_cache=False)
        return out.last_hidden_state[0]

    __call__ = forward

    def _head(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype, through the lean forward's head when it runs."""
        if self._use_lean and hidden_states.dim() == 2:
            return self._lean.lm_head(hidden_states)
        self._hf_weights()
        return self._lm_head(hidden_states)

    @torch.inference_mode()
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[N, vocab]`` fp32 logits for the ``N`` rows that sample."""
        return self._head(hidden_states).float()

    @torch.inference_mode()
    def greedy_token_ids(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[N]`` argmax tokens, the same as ``compute_logits(h).argmax(-1)``.

        The argmax is taken on the logits in the model's dtype: widening to
        fp32 is exact and order-preserving, so it cannot change the result,
        and skipping it saves a ``[N, vocab]`` copy per step in bf16. Over an
        8-bit LM head, rows of a batch take the lean forward's screened argmax
        (:func:`~omnistage.kernels.group_int8.group_int8_argmax`): each row's
        token is the argmax of its logits computed alone, which differ from
        the batch matmul's by the roundings of a summation order.
        """
        if self._use_lean and hidden_states.dim() == 2:
            ids = self._lean.greedy_ids(hidden_states)
            if ids is not None:
                return ids
        return first_argmax(self._head(hidden_states))

    @torch.inference_mode()
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` token ids -> ``[T, hidden]`` input embeddings."""
        if self._lean is not None:
            return self._lean.embed_ids(input_ids)
        return self._embed(input_ids)
