"""The Qwen3-Omni talker on paged attention, and its code predictor.

Per request the talker keeps a ``Qwen3TalkerState`` (the stage's payload):

- ``prefill_embeds`` ``[P, H]``: transformers' talker prompt, i.e. the user
  turns (``hidden_projection`` of the thinker's accepted layer at media
  placeholders, ``text_projection`` of the input embedding elsewhere) then the
  9 assistant rows (3 role tokens, 4 ``tts_pad``, ``tts_bos``, the first text
  token, plus the codec rows nothink / think_bos / think_eos / speaker / pad /
  bos); ``positions`` ``[3, P]`` and ``rope_delta`` (M-RoPE over the talker's
  ids when the prompt has media, else ``0..P-1``);
- ``trailing`` ``[R, H]``: one text row per decode step (the rest of the
  answer, then ``tts_eos``), ``tts_pad`` once they run out;
- ``frames``: the codes of every frame sampled so far (``[num_code_groups]``
  each: the talker's code, then the code predictor's), and ``frame_embeds``:
  the sum of the frame's code embeddings, which is the next step's input.

One talker step, for each request that samples (transformers' talker
``generate`` runs the same math one step later, in ``prepare_inputs_for_generation``):

1. the decoder gives logits over the codec vocabulary; the runner samples
   code 0 with the talker's ``SamplingParams`` (suppressions, repetition
   penalty, stop at codec EOS);
2. ``deferred_outputs`` runs the code predictor, batched over those requests
   (all have the same length, so no padding): prefill on ``[last hidden,
   embed(code 0)]``, then one step per remaining code group, each with its
   own head and embedding table. Greedy when the talker is greedy, else
   temperature 1, top-k 50, top-p 0.8 (transformers' defaults), from the
   request's own generator;
3. the frame is appended to the state (it survives a preemption: the state is
   the request's, and a recomputed request re-reads its frames) and returned
   as the deferred key ``codes.audio`` (one row per scheduled token, the
   frame at the sampling token, -1 elsewhere), which the tensor prefix cache
   stages and commits on finish.

The last sampled code (codec EOS, or the one that hit ``max_tokens``) has no
frame in transformers' output: its residual codes are never computed there,
so the vocoder gets ``frames[: len(codes) - 1]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from omnistage.attention.paged_attention import AttentionMetadata, StepLayout
from omnistage.models.adapter import CausalLM
from omnistage.models.interface import TensorCachePolicy
from omnistage.models.mm_loader import TextStackView

__all__ = ["CODES_KEY", "PagedQwen3OmniTalker", "Qwen3TalkerPrep", "Qwen3TalkerState"]

CODES_KEY = "codes.audio"
# transformers' code predictor when the talker samples (its generation config: temperature 1).
CODE_PREDICTOR_TOP_K, CODE_PREDICTOR_TOP_P = 50, 0.8


@dataclass
class Qwen3TalkerState:
    """One talker request's inputs and the frames it has produced (see the module docstring)."""

    prefill_embeds: torch.Tensor
    positions: torch.Tensor
    rope_delta: int
    trailing: torch.Tensor
    tts_pad: torch.Tensor
    prompt_ids: list[int]
    greedy: bool = True
    generator: torch.Generator | None = None
    frames: list[list[int]] = field(default_factory=list)
    frame_embeds: list[torch.Tensor] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return self.prefill_embeds.shape[0]


class Qwen3TalkerPrep:
    """Builds a request's ``Qwen3TalkerState`` from the thinker's hand-off, as
    ``Qwen3OmniMoeForConditionalGeneration.generate`` builds the talker's inputs
    for one row (the batch-only ``tts_eos`` move after an early EOS never applies
    to a single answer, which ends at its EOS)."""

    def __init__(self, hf: Any, thinker_adapter: Any) -> None:
        self.config = hf.config
        self.talker = hf.talker
        tc = self.config.talker_config
        self._mm_ids = torch.tensor(
            [self.config.thinker_config.audio_token_id, self.config.thinker_config.image_token_id,
             self.config.thinker_config.video_token_id]
        )  # fmt: skip
        table = thinker_adapter.language_model.embed_tokens
        special = torch.tensor(
            [
                self.config.tts_bos_token_id,
                self.config.tts_eos_token_id,
                self.config.tts_pad_token_id,
            ]
        )
        with torch.inference_mode():
            rows = self.talker.text_projection(table(special.to(table.weight.device)))
        self.tts_bos, self.tts_eos, self.tts_pad = (r.clone() for r in rows)
        self._codec_ids = [
            tc.codec_nothink_id,
            tc.codec_think_bos_id,
            tc.codec_think_eos_id,
        ]
        self._codec_tail = [tc.codec_pad_id, tc.codec_bos_id]

    @torch.inference_mode()
    def prepare(
        self,
        handoff: Any,
        speaker_id: int,
        greedy: bool = True,
        seed: int | None = None,
    ) -> Qwen3TalkerState:
        """``handoff``: a ``ThinkerOutputForTalker`` (prompt ids, output ids, the ``[P + G - 1, D]`` rows, grids)."""
        cfg = self.config
        ids = torch.tensor(handoff.prompt_token_ids, dtype=torch.long)
        rows = handoff.thinker_states
        p = ids.shape[0]
        device = self.tts_pad.device
        rows = rows.to(device)
        # Each prompt position belongs to the turn opened by the last <|im_start|> at or before it.
        pos = torch.arange(p)
        starts = torch.where(
            ids == cfg.im_start_token_id, pos, torch.full_like(pos, -1)
        )
        previous = torch.cummax(starts, dim=0).values.clamp_min(0)
        role = ids[(previous + 1).clamp_max(p - 1)]
        user = (role == cfg.user_token_id).nonzero().flatten()
        is_mm = torch.isin(ids, self._mm_ids)
        user_rows = torch.empty(
            user.numel(),
            self.tts_pad.shape[-1],
            dtype=self.tts_pad.dtype,
            device=device,
        )
        mm_user = is_mm[user]
        if bool(mm_user.any()):
            user_rows[mm_user.to(device)] = self.talker.hidden_projection(
                rows[user[mm_user]]
            )
        user_rows[~mm_user.to(device)] = self.talker.text_projection(
            rows[user[~mm_user]]
        )
        starts_assistant = (
            (ids[:-1] == cfg.im_start_token_id) & (ids[1:] == cfg.assistant_token_id)
        ).nonzero()
        if starts_assistant.numel() == 0:
            raise ValueError(
                f"request {handoff.request_id!r}: its prompt has no assistant turn for the talker"
            )
        a = int(starts_assistant.flatten()[-1])
        assistant = self.talker.text_projection(rows[a:])
        codec_embed = self.talker.get_input_embeddings()
        codec = codec_embed(
            torch.tensor(
                [*self._codec_ids, speaker_id, *self._codec_tail], device=device
            )
        )
        text = torch.cat(
            [
                assistant[:3],
                self.tts_pad.expand(4, -1),
                self.tts_bos[None],
                assistant[3:4],
            ]
        )
        zeros = torch.zeros(3, codec.shape[-1], dtype=codec.dtype, device=device)
        tail = text + torch.cat([zeros, codec])
        prefill = torch.cat([user_rows, tail])
        trailing = torch.cat([assistant[4:], self.tts_eos[None]])
        talker_ids = torch.cat(
            [
                ids[user],
                torch.full((tail.shape[0],), cfg.tts_pad_token_id, dtype=torch.long),
            ]
        )
        positions, delta = self._positions(talker_ids, handoff)
        generator = (
            None
            if greedy
            else torch.Generator(device=device).manual_seed(int(seed or 0))
        )
        prompt_ids = [int(self._codec_tail[0])] * prefill.shape[
            0
        ]  # a suppressed id: repetition penalty sees none
        return Qwen3TalkerState(
            prefill.contiguous(),
            positions,
            delta,
            trailing.contiguous(),
            self.tts_pad,
            prompt_ids,
            greedy,
            generator,
        )

    def _positions(
        self, talker_ids: torch.Tensor, handoff: Any
    ) -> tuple[torch.Tensor, int]:
        grids = (handoff.image_grid_thw, handoff.video_grid_thw)
        has_mm = handoff.audio_seqlens is not None or any(
            g is not None and g.numel() > 0 for g in grids
        )
        n = talker_ids.shape[0]
        if not has_mm:
            return torch.arange(n, dtype=torch.long).expand(3, -1).contiguous(), 0
        positions, delta = self.talker.get_rope_index(
            talker_ids[None], handoff.image_grid_thw, handoff.video_grid_thw, torch.ones(1, n, dtype=torch.long),
            False, handoff.audio_seqlens, handoff.second_per_grids,
        )  # fmt: skip
        return positions[:, 0].to(torch.long).contiguous(), int(delta.reshape(-1)[0])


class PagedQwen3OmniTalker:
    """``Qwen3OmniMoeTalkerForConditionalGeneration`` on paged attention, inputs from ``Qwen3TalkerState``."""

    tensor_cache_policy = TensorCachePolicy(deferred_keys=frozenset({CODES_KEY}))

    def __init__(self, talker: Any) -> None:
        # Only the decoder switches to paged attention: the code predictor keeps
        # transformers' attention (it runs dense, on a fresh cache per frame).
        self._lm = CausalLM(TextStackView(talker.model, talker.codec_head))  # type: ignore[arg-type]
        self.talker = talker
        self.code_predictor = talker.code_predictor
        self._codec_embed = talker.model.codec_embedding
        self._cp_embeds = self.code_predictor.model.get_input_embeddings()
        self.num_code_groups = int(talker.config.num_code_groups)
        self.num_layers = self._lm.num_layers
        self.num_kv_heads = self._lm.num_kv_heads
        self.head_dim = self._lm.head_dim
        self.hidden_size = self._lm.hidden_size
        self.vocab_size = self._lm.vocab_size
        self._states: list[
            Qwen3TalkerState
        ] = []  # the step's, in step order (step_inputs -> deferred_outputs)

    @property
    def dtype(self) -> torch.dtype:
        return self._lm.dtype

    @property
    def device(self) -> torch.device:
        return self._lm.device

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
            raise ValueError(
                "PagedQwen3OmniTalker.forward: the talker runs on inputs_embeds (step_inputs), got none"
            )
        return self._lm.forward(
            input_ids, positions, attn_metadata, kv_caches, inputs_embeds=inputs_embeds
        )

    __call__ = forward

    @torch.inference_mode()
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self._lm.compute_logits(hidden_states)

    @torch.inference_mode()
    def step_inputs(
        self, step: StepLayout, states: Sequence[Qwen3TalkerState]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, H]`` inputs and ``[3, T]`` positions. Token ``i`` of a request enters as:

        - ``i < P``: ``prefill_embeds[i]`` at ``positions[:, i]``;
        - ``i >= P`` (code 0 of frame ``f = i - P``): ``frame_embeds[f] + trailing[f]``
          (``tts_pad`` past the trailing rows) at ``i + rope_delta`` on all axes.
        """
        self._states = list(states)
        rows: list[torch.Tensor] = []
        positions: list[torch.Tensor] = []
        for state, start, end in zip(
            states, step.num_computed_tokens.tolist(), step.seq_lens.tolist()
        ):
            p = state.num_prompt_tokens
            if start < p:
                stop = min(end, p)
                rows.append(state.prefill_embeds[start:stop])
                positions.append(state.positions[:, start:stop])
            if end > p:
                first = max(start, p)
                r = state.trailing.shape[0]
                for f in range(first - p, end - p):
                    text = state.trailing[f] if f < r else state.tts_pad
                    rows.append((state.frame_embeds[f] + text)[None])
                idx = torch.arange(first, end) + state.rope_delta
                positions.append(idx.expand(3, -1))
        x = torch.cat(rows) if len(rows) > 1 else rows[0]
        pos = torch.cat(positions, dim=1) if len(positions) > 1 else positions[0]
        return x, pos

    # ------------------------------------------------------------ code predictor

    @torch.inference_mode()
    def deferred_outputs(
        self, step: StepLayout, hidden: torch.Tensor, runner_output: Any
    ) -> dict[str, torch.Tensor]:
        """Run the code predictor for every request that sampled code 0 this step (see the module docstring)."""
        sampled = runner_output.req_ids
        step_states, self._states = self._states, []  # this step's only: nothing kept past it
        if not sampled:
            return {}
        index = {r: i for i, r in enumerate(step.req_ids)}
        states = [step_states[index[r]] for r in sampled]
        code0 = torch.tensor(
            [runner_output.sampled_token_ids[r] for r in sampled], device=self.device
        )
        last = hidden.index_select(0, step.logits_indices[: len(sampled)])
        frames, embeds = self.predict_frames(last, code0, states)
        out = torch.full((step.num_tokens, self.num_code_groups), -1, dtype=torch.long)
        qsl = step.query_start_loc
        for state, frame, embed, r in zip(states, frames.tolist(), embeds, sampled):
            state.frames.append(frame)
            state.frame_embeds.append(embed)
            out[int(qsl[index[r] + 1]) - 1] = torch.tensor(frame)
        return {CODES_KEY: out}

    @torch.inference_mode()
    def predict_frames(
        self,
        last_hidden: torch.Tensor,
        code0: torch.Tensor,
        states: Sequence[Qwen3TalkerState],
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``[B, num_code_groups]`` codes and each frame's summed code embedding ``[H]``."""
        from transformers import DynamicCache

        cp = self.code_predictor
        first = self._codec_embed(code0)
        x = torch.stack([last_hidden, first], dim=1)  # [B, 2, H]
        cache = DynamicCache(config=cp.config)
        embeds = [first]
        codes = [code0]
        for k in range(self.num_code_groups - 1):
            out = cp.model(inputs_embeds=x, cache=cache, use_cache=True)
            logits = cp.lm_head[k](out.last_hidden_state[:, -1]).float()
            code = self._pick(logits, states)
            codes.append(code)
            x = self._cp_embeds[k](code)[:, None]
            embeds.append(x[:, 0])
        summed = torch.stack(embeds, dim=1).sum(1)
        return torch.stack(codes, dim=1).cpu(), list(summed)

    @staticmethod
    def _pick(logits: torch.Tensor, states: Sequence[Qwen3TalkerState]) -> torch.Tensor:
        greedy = logits.argmax(-1)
        if all(s.greedy for s in states):
            return greedy
        picked = greedy.clone()
        for i, state in enumerate(states):
            if not state.greedy:
                picked[i] = _sample_top_k_top_p(
                    logits[i],
                    CODE_PREDICTOR_TOP_K,
                    CODE_PREDICTOR_TOP_P,
                    state.generator,
                )
        return picked


def _sample_top_k_top_p(
    logits: torch.Tensor, top_k: int, top_p: float, generator: torch.Generator | None
) -> int:
    """transformers' TopK then TopP warpers (temperature 1), then one multinomial draw."""
    scores = logits.clone()
    k = min(top_k, scores.shape[-1])
    kth = torch.topk(scores, k).values[-1]
    scores[scores < kth] = float("-inf")
    sorted_scores, order = torch.sort(scores, descending=False)
    cumulative = sorted_scores.softmax(-1).cumsum(-1)
    remove = cumulative <= (1 - top_p)
    remove[-1] = False
    scores[order[remove]] = float("-inf")
    probs = scores.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))
