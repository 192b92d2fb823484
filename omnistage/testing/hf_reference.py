"""transformers as the reference omnistage is tested against.

Helpers that run ``transformers``' own models on the same inputs omnistage
gets, so a test compares the two outputs token for token:

- :func:`hf_reference_inputs`: the keyword arguments of transformers'
  forward / ``generate`` for a prompt omnistage's processor produced
  (Qwen2.5-VL, the Qwen2.5-Omni thinker);
- :func:`hf_generate_capturing_stages`: transformers' whole Qwen2.5-Omni
  ``generate`` with what it passes between thinker, talker and token2wav
  recorded;
- :func:`handoff_from_hf_generate`: the thinker-to-talker hand-off computed
  from that ``generate``'s thinker result;
- :func:`talker_from_omni_model` / :func:`token2wav_from_omni_model`: the
  omnistage stage models around a loaded transformers Qwen2.5-Omni, and
  :func:`talker_greedy_codes`, the one-request greedy talker loop over them
  (HF modules and a ``DynamicCache``), what the paged talker stage must match.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from omnistage.models.qwen2_5_omni_talker import Qwen2_5OmniTalker, ThinkerOutputForTalker, thinker_states_for_talker
from omnistage.models.qwen2_5_omni_token2wav import Qwen2_5OmniToken2Wav
from omnistage.testing.tiny_omni_checkpoint import TALKER_EOS_TOKEN_IDS

__all__ = [
    "handoff_from_hf_generate",
    "hf_generate_capturing_stages",
    "hf_reference_inputs",
    "talker_from_omni_model",
    "talker_greedy_codes",
    "token2wav_from_omni_model",
]


def hf_reference_inputs(model: Any, out: Any, ids: torch.Tensor) -> dict[str, Any]:
    """transformers' forward / ``generate`` keyword arguments for a processed prompt
    (an ``omnistage.multimodal.processing.ProcessedPrompt``) whose tokens are ``ids``
    ``[1, T]``: what tests compare omnistage against, for Qwen2.5-VL and the
    Qwen2.5-Omni thinker. Audio features of several items are padded into one batch."""

    def cat(modality: str, key: str) -> torch.Tensor | None:
        values = [f.data[key] for f in out.mm_features if f.modality == modality]
        return torch.cat(values) if values else None

    kwargs: dict[str, Any] = dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        pixel_values=cat("image", "pixel_values"),
        image_grid_thw=cat("image", "image_grid_thw"),
        pixel_values_videos=cat("video", "pixel_values_videos"),
        video_grid_thw=cat("video", "video_grid_thw"),
    )
    if model.config.model_type == "qwen2_5_vl":
        token_type = torch.zeros_like(ids)
        token_type[ids == model.config.image_token_id] = 1
        token_type[ids == model.config.video_token_id] = 2
        kwargs.update(mm_token_type_ids=token_type, second_per_grid_ts=cat("video", "second_per_grid_ts"))
    else:
        audio = [f.data["input_features"] for f in out.mm_features if f.modality == "audio"]
        if audio:
            n = max(a.shape[1] for a in audio)
            feats = torch.zeros(len(audio), audio[0].shape[0], n)
            mask = torch.zeros(len(audio), n, dtype=torch.long)
            for k, a in enumerate(audio):
                feats[k, :, : a.shape[1]] = a
                mask[k, : a.shape[1]] = 1
            kwargs.update(input_features=feats, feature_attention_mask=mask)
        kwargs.update(video_second_per_grid=cat("video", "second_per_grid_ts"))
    return {k: v for k, v in kwargs.items() if v is not None}


def hf_generate_capturing_stages(model: Any, input_ids: torch.Tensor, seed: int = 0, **kwargs: Any) -> dict[str, Any]:
    """transformers' ``model.generate`` with a greedy talker after ``torch.manual_seed(seed)``, for tests.

    Returns what that one call passed between its stages: ``thinker`` (the
    thinker's ``generate`` result), ``talker_kwargs`` (the talker's inputs,
    cloned) and ``talker`` (its output), plus ``codes`` (the talker's new
    codes up to its first EOS), ``sequences`` and ``wav``.
    """
    seen: dict[str, Any] = {}
    thinker_generate, talker_generate = model.thinker.generate, model.talker.generate

    def thinker_wrapper(**kw: Any) -> Any:
        seen["thinker"] = thinker_generate(**kw)
        return seen["thinker"]

    def talker_wrapper(**kw: Any) -> Any:
        seen["talker_kwargs"] = {k: v.clone() if torch.is_tensor(v) else v for k, v in kw.items()}
        seen["talker"] = talker_generate(**kw)
        return seen["talker"]

    model.thinker.generate, model.talker.generate = thinker_wrapper, talker_wrapper
    try:
        torch.manual_seed(seed)
        sequences, wav = model.generate(
            input_ids, talker_do_sample=False, talker_eos_token_id=TALKER_EOS_TOKEN_IDS, **kwargs
        )
    finally:
        del model.thinker.generate, model.talker.generate
    codes = seen["talker"][0, seen["talker_kwargs"]["input_ids"].shape[1] :].tolist()
    stop = next((i for i, c in enumerate(codes) if c in TALKER_EOS_TOKEN_IDS), len(codes))
    return {**seen, "codes": codes[:stop], "sequences": sequences, "wav": wav}


def handoff_from_hf_generate(
    model: Any,
    input_ids: torch.Tensor,
    thinker_result: Any,
    request_id: str = "0",
    **mm: Any,
) -> ThinkerOutputForTalker:
    """The hand-off for batch row 0, computed from a thinker ``generate``
    result run with ``output_hidden_states=True, return_dict_in_generate=True``
    (the reference the engine's thinker stage must match). ``mm`` takes the
    grid fields of ``ThinkerOutputForTalker``; placeholder tokens of every
    modality are treated as multimodal."""
    cfg = model.config.thinker_config
    steps = thinker_result.hidden_states
    embeds = torch.cat([step[0][0] for step in steps])  # [P + G - 1, D]
    hidden = torch.cat([step[-1][0] for step in steps])
    token_ids = torch.cat([input_ids[0], thinker_result.sequences[0, input_ids.shape[1] :]])[: embeds.shape[0]]
    placeholders = torch.tensor([cfg.audio_token_index, cfg.image_token_index, cfg.video_token_index])
    is_mm = torch.isin(token_ids.cpu(), placeholders).to(embeds.device)
    states = thinker_states_for_talker(hidden, embeds, is_mm)
    return ThinkerOutputForTalker(
        request_id=request_id,
        prompt_token_ids=input_ids[0].tolist(),
        output_token_ids=thinker_result.sequences[0, input_ids.shape[1] :].tolist(),
        thinker_states=states,
        **mm,
    )


def talker_from_omni_model(model: Any, match_transformers_unpadded: bool = False) -> Qwen2_5OmniTalker:
    """The talker of a transformers ``Qwen2_5OmniForConditionalGeneration``
    loaded with ``from_pretrained`` (its ``speaker_map`` set), with the
    thinker embedding rows it needs copied out."""
    ids = {int(p["bos_token"]) for p in model.speaker_map.values()}
    ids |= {int(model.talker.config.tts_text_end_token_id), int(model.talker.config.tts_text_pad_token_id)}
    table = model.thinker.get_input_embeddings()
    with torch.no_grad():
        rows = {i: table(torch.tensor([i], device=table.weight.device))[0].clone() for i in sorted(ids)}
    return Qwen2_5OmniTalker(model.talker, rows, match_transformers_unpadded)


def token2wav_from_omni_model(model: Any) -> Qwen2_5OmniToken2Wav:
    """The token2wav stage model of a loaded transformers Qwen2.5-Omni."""
    return Qwen2_5OmniToken2Wav(model.token2wav, model.speaker_map)


@torch.no_grad()
def talker_greedy_codes(
    talker: Qwen2_5OmniTalker,
    handoff: ThinkerOutputForTalker,
    speaker_bos_token_id: int,
    max_new_tokens: int,
    eos_token_ids: Sequence[int] | None = None,
    repetition_penalty: float = 1.0,
) -> list[int]:
    """Greedy codec tokens for one request, EOS excluded: the talker's
    ``prepare`` / ``decode_inputs`` / ``forward`` stepped one token at a time
    over a ``DynamicCache``, equal to ``generate(..., talker_do_sample=False)``.
    ``eos_token_ids`` defaults to ``generate``'s ``talker_eos_token_id``
    (codec pad and codec end)."""
    from transformers import DynamicCache

    config = talker.config
    default_eos = (int(config.tts_codec_pad_token_id), int(config.tts_codec_end_token_id))
    eos = set(default_eos if eos_token_ids is None else eos_token_ids)
    prompt = talker.prepare(handoff, speaker_bos_token_id)
    cache = DynamicCache(config=config)
    seen = list(prompt.prompt_codec_ids)
    codes: list[int] = []
    logits = talker.forward(prompt.prefill_embeds[None], prompt.positions[:, None], cache)[0, -1]
    for step in range(max_new_tokens):
        code = _greedy_code(logits, seen, repetition_penalty, suppressed=talker.codec_bos)
        if code in eos:
            break
        codes.append(code)
        seen.append(code)
        if step + 1 == max_new_tokens:
            break
        index = prompt.num_prompt_tokens + step
        row = prompt.reply[min(step, prompt.reply.shape[0] - 1)]
        embeds = talker.decode_inputs(torch.tensor([code], device=talker.device), row[None])
        position = torch.full((3, 1, 1), index + prompt.rope_delta, device=talker.device)
        logits = talker.forward(embeds[None], position, cache)[0, -1]
    return codes


def _greedy_code(logits: torch.Tensor, seen: list[int], repetition_penalty: float, suppressed: int) -> int:
    """transformers' repetition penalty over ``seen``, ``suppressed`` masked, then argmax."""
    scores = logits.clone()
    if repetition_penalty != 1.0:
        ids = torch.tensor(seen, device=scores.device)
        picked = scores.gather(0, ids)
        picked = torch.where(picked < 0, picked * repetition_penalty, picked / repetition_penalty)
        scores.scatter_(0, ids, picked)
    scores[suppressed] = float("-inf")  # generate(..., suppress_tokens=[codec_bos])
    return int(torch.argmax(scores))
