"""Helpers for the Qwen3-Omni pipeline tests."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

EOS = "<|im_end|>"


def chat_ids(tokenizer: Any, *turns: str) -> list[int]:
    """Token ids of a chat: alternating user / assistant turns, then the generation prompt."""
    roles = ["user", "assistant"]
    messages = [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    return list(tokenizer(text).input_ids)


def hf_generate(
    hf: Any,
    tokenizer: Any,
    ids: list[int],
    max_new_tokens: int,
    talker_max_new_tokens: int,
    speaker: str = "Ethan",
    **kwargs: Any,
) -> tuple[list[int], np.ndarray, np.ndarray]:
    """transformers' greedy ``generate`` (talker and code predictor greedy, no repetition
    penalty): ``(thinker tokens, codes [groups, frames], waveform)``."""
    captured: list[torch.Tensor] = []
    original = hf.code2wav.chunked_decode

    def spy(codes: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        captured.append(codes.clone())
        return original(codes, *args, **kw)

    hf.code2wav.chunked_decode = spy
    try:
        torch.manual_seed(0)
        seq, wav = hf.generate(
            input_ids=torch.tensor([ids]), thinker_max_new_tokens=max_new_tokens, thinker_do_sample=False,
            thinker_eos_token_id=tokenizer.convert_tokens_to_ids(EOS), talker_do_sample=False,
            talker_repetition_penalty=1.0, talker_max_new_tokens=talker_max_new_tokens, speaker=speaker, **kwargs,
        )  # fmt: skip
    finally:
        del hf.code2wav.chunked_decode
    return (
        seq[0, len(ids) :].tolist(),
        captured[0][0].numpy(),
        wav.reshape(-1).float().numpy(),
    )


def frames_of(out: Any) -> np.ndarray:
    """``[groups, frames]`` codes of an omnistage output."""
    return np.asarray(out.extra["codec_frames"], dtype=np.int64).T


def assert_same_answer(a: Any, b: Any) -> None:
    """Same thinker tokens, same codes of every group, same waveform (same length, 1e-6 per
    sample: the code2wav stage decodes the requests it holds in one padded batch, and a
    different batch changes only float rounding)."""
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert a.extra.get("codec_frames") == b.extra.get("codec_frames")
    if a.audio is None or b.audio is None:
        assert a.audio is None and b.audio is None
    else:
        assert a.audio.dtype == np.float32 and a.audio.shape == b.audio.shape
        np.testing.assert_allclose(a.audio, b.audio, rtol=0, atol=1e-6)


def assert_nothing_held(llm: Any) -> None:
    held = llm.llm_engine.held()
    assert all(h.is_empty for h in held.values()), {
        k: v for k, v in held.items() if not v.is_empty
    }


def run_until_idle(llm: Any, max_steps: int = 10_000) -> list[Any]:
    outs = []
    for _ in range(max_steps):
        if not llm.llm_engine.has_unfinished_requests():
            return outs
        outs.extend(o for o in llm.llm_engine.step() if o.finished)
    raise AssertionError("the pipeline did not go idle")
