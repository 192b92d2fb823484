"""Qwen2.5-Omni talker stage: thinker per-token states -> codec tokens.

What the thinker hands over (``ThinkerOutputForTalker``, plain data)
--------------------------------------------------------------------
transformers' ``Qwen2_5OmniForConditionalGeneration.generate`` runs the
thinker with ``output_hidden_states=True`` and reads two tensors per token the
thinker *forwarded*: ``hidden_states[step][0]`` (the input embedding, after the
multimodal merge) and ``hidden_states[step][-1]`` (the last layer's output
after the final norm, i.e. what ``lm_head`` sees). It zeroes the input
embedding at image / video / audio placeholder positions and only ever uses
the sum. So the hand-off is one ``[num_tokens, thinker_hidden]`` tensor,

    thinker_states[i] = final_norm_hidden[i] + (0 if token i is a multimodal
                        placeholder else embed_tokens(token_ids[i]))

for the ``P`` prompt tokens and the first ``G - 1`` generated tokens (the last
generated token, usually EOS, is never forwarded by the thinker), plus the
token ids (for M-RoPE and EOS) and the multimodal grid sizes of the prompt.

How the talker conditions on it
-------------------------------
The talker is a Qwen2-style decoder (own config: ``embedding_size`` =
thinker hidden, its own ``hidden_size``/heads/``head_dim``, M-RoPE with its own
``mrope_section``) whose input is ``thinker_to_talker_proj(x)`` where ``x`` has
the thinker width:

- prefill (``P + 2`` rows): ``thinker_states[:P]``;
  ``text_embed(speaker bos) + codec_embed(codec_pad)``;
  ``thinker_states[P] + codec_embed(codec_bos)`` (first generated token);
- decode step ``t >= 1``: ``codec_embed(code[t-1]) + reply[min(t-1, R-1)]``
  where ``reply = thinker_states[P+1:] ++ [text_embed(tts_text_end),
  text_embed(tts_text_pad)]`` (the last row repeats for ever).

Positions are ``get_rope_index`` over the text ids ``prompt ++ [speaker bos,
first generated token]`` (identical to the thinker's M-RoPE positions of the
prompt; the two tail tokens are text, even a media start token the thinker
generated), then ``index + rope_delta``. Generation suppresses ``codec_bos``,
applies ``repetition_penalty`` over ``[codec_mask] * P + [codec_pad,
codec_bos] + codes``, and stops at ``codec_pad`` or ``codec_end`` (which is
not returned).

transformers 5.24 quirk: ``generate`` drops an all-ones attention mask
before calling ``forward``, and the talker's ``forward`` only adds the two
codec embeddings and computes M-RoPE positions when it gets a mask. So a
single (unpadded) request through ``Qwen2_5OmniForConditionalGeneration.
generate`` gets neither: its prefill rows are the bare thinker rows and its
positions are ``0, 1, 2, ...`` on all axes, while rows of a left-padded batch
(and every request in transformers 4.x, where the talker was written) get
both. ``Qwen2_5OmniTalker`` follows the model as designed by default;
``match_transformers_unpadded=True`` reproduces the 5.24 single-request path.

``Qwen2_5OmniTalker`` holds the pieces an engine needs as separate methods:
``prepare`` (per-request prompt, once), ``decode_inputs`` (per step, one
gather), ``forward`` (projection + decoder + codec head on ``inputs_embeds``).
The one-request greedy reference loop over them (HF modules and a
``DynamicCache``) is ``omnistage.testing.hf_reference.talker_greedy_codes``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "Qwen2_5OmniTalker",
    "TalkerPrompt",
    "ThinkerOutputForTalker",
    "thinker_states_for_talker",
]


def thinker_states_for_talker(
    final_hidden: torch.Tensor, inputs_embeds: torch.Tensor, is_multimodal: torch.Tensor
) -> torch.Tensor:
    """The per-token tensor the thinker stage keeps for the talker, for a
    step's packed tokens: ``final_hidden`` ``[T, D]`` (after the final norm),
    plus ``inputs_embeds`` ``[T, D]`` where ``is_multimodal`` ``[T]`` is False
    (placeholder rows take the hidden state alone). One vectorized op."""
    return final_hidden + torch.where(is_multimodal[:, None], torch.zeros_like(inputs_embeds), inputs_embeds)


@dataclass
class ThinkerOutputForTalker:
    """What the thinker stage hands to the talker stage for one request.

    ``thinker_states`` is ``[len(prompt_token_ids) + len(output_token_ids) - 1,
    thinker_hidden]`` (see the module docstring). The grid fields are the
    prompt's multimodal metadata as the processor returns them (``None`` when
    the prompt has no such item); they only affect M-RoPE positions.
    """

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    thinker_states: torch.Tensor
    image_grid_thw: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    audio_seqlens: torch.Tensor | None = None
    second_per_grids: torch.Tensor | None = None
    use_audio_in_video: bool = False

    def __post_init__(self) -> None:
        expected = len(self.prompt_token_ids) + len(self.output_token_ids) - 1
        if self.thinker_states.ndim != 2 or self.thinker_states.shape[0] != expected:
            raise ValueError(
                f"request {self.request_id}: thinker_states must be [prompt + generated - 1 = {expected}, hidden], "
                f"got {tuple(self.thinker_states.shape)}"
            )
        if len(self.output_token_ids) < 2:
            raise ValueError(
                f"request {self.request_id}: the talker needs at least 2 thinker tokens (the first one is "
                f"conditioned on the thinker's state after it), got {len(self.output_token_ids)}"
            )


@dataclass
class TalkerPrompt:
    """Per-request talker state built once from a hand-off.

    ``prefill_embeds`` ``[P + 2, thinker_hidden]`` (before projection),
    ``reply`` ``[R, thinker_hidden]`` (decode step ``t`` uses row
    ``min(t - 1, R - 1)``), ``positions`` ``[3, P + 2]``; a token at index
    ``i >= P + 2`` has position ``i + rope_delta`` on all three axes.
    ``prompt_codec_ids`` are the ids repetition penalty counts as seen.
    """

    prefill_embeds: torch.Tensor
    reply: torch.Tensor
    positions: torch.Tensor
    rope_delta: int
    prompt_codec_ids: list[int] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return self.prefill_embeds.shape[0]


class Qwen2_5OmniTalker:
    """The talker of a loaded ``Qwen2_5OmniForConditionalGeneration``.

    Holds the talker module and the few thinker embedding rows it needs
    (speaker bos ids, ``tts_text_end``, ``tts_text_pad``), so a talker stage
    never needs the thinker's weights.
    """

    def __init__(
        self, talker: Any, text_embeddings: dict[int, torch.Tensor], match_transformers_unpadded: bool = False
    ) -> None:
        self.talker = talker.eval()
        self.match_transformers_unpadded = match_transformers_unpadded
        self.config = talker.config
        self.codec_embed = talker.get_input_embeddings()
        self.text_embeddings = text_embeddings
        self.codec_bos = int(self.config.tts_codec_start_token_id)
        self.codec_pad = int(self.config.tts_codec_pad_token_id)
        self.codec_mask = int(self.config.tts_codec_mask_token_id)
        self.text_end = int(self.config.tts_text_end_token_id)
        self.text_pad = int(self.config.tts_text_pad_token_id)

    @property
    def device(self) -> torch.device:
        return self.codec_embed.weight.device

    def _text_row(self, token_id: int) -> torch.Tensor:
        if token_id not in self.text_embeddings:
            raise KeyError(f"no thinker embedding row for token id {token_id} (unknown speaker bos?)")
        return self.text_embeddings[token_id]

    def _codec_row(self, token_id: int) -> torch.Tensor:
        return self.codec_embed(torch.tensor([token_id], device=self.device))[0]

    @torch.no_grad()
    def prepare(self, handoff: ThinkerOutputForTalker, speaker_bos_token_id: int) -> TalkerPrompt:
        """Build the talker's prefill inputs, reply rows and positions."""
        num_prompt = len(handoff.prompt_token_ids)
        states = handoff.thinker_states.to(self.device)
        bos_row = self._text_row(speaker_bos_token_id)
        first_row = states[num_prompt]
        if not self.match_transformers_unpadded:
            bos_row = bos_row + self._codec_row(self.codec_pad)
            first_row = first_row + self._codec_row(self.codec_bos)
        prefill = torch.cat([states[:num_prompt], bos_row[None], first_row[None]])
        reply = torch.cat(
            [states[num_prompt + 1 :], self._text_row(self.text_end)[None], self._text_row(self.text_pad)[None]]
        )
        # The tail (speaker bos, first generated token) is text. The generated token is
        # given as the speaker bos too: get_rope_index would take a media start token
        # there for an item of the prompt and fail; any text id gets the same positions.
        text_ids = torch.tensor([[*handoff.prompt_token_ids, speaker_bos_token_id, speaker_bos_token_id]])
        if self.match_transformers_unpadded:
            positions, delta = torch.arange(num_prompt + 2).expand(3, -1), 0
        else:
            rope, deltas = self.talker.get_rope_index(
                text_ids,
                handoff.image_grid_thw,
                handoff.video_grid_thw,
                torch.ones_like(text_ids),
                handoff.use_audio_in_video,
                handoff.audio_seqlens,
                handoff.second_per_grids,
            )
            positions, delta = rope[:, 0], int(deltas.reshape(-1)[0])
        return TalkerPrompt(
            prefill_embeds=prefill,
            reply=reply,
            positions=positions.to(self.device),
            rope_delta=delta,
            prompt_codec_ids=[self.codec_mask] * num_prompt + [self.codec_pad, self.codec_bos],
        )

    def decode_inputs(self, codes: torch.Tensor, reply_rows: torch.Tensor) -> torch.Tensor:
        """``[N]`` last codec ids + ``[N, thinker_hidden]`` reply rows -> the
        ``[N, thinker_hidden]`` decode inputs (before projection)."""
        return self.codec_embed(codes) + reply_rows

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, cache: Any) -> torch.Tensor:
        """``[B, L, thinker_hidden]`` inputs, ``[3, B, L]`` positions -> fp32
        codec logits ``[B, L, vocab]`` (projection, decoder, codec head)."""
        out = self.talker(inputs_embeds=inputs_embeds, position_ids=positions, cache=cache, use_cache=True)
        return out.logits
