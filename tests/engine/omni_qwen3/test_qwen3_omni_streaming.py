"""Qwen3-Omni streams through the chunked vocoder stage: ``generate_stream``'s audio
chunks arrive while the talker still speaks and concatenate to exactly
``generate``'s waveform (same length, 1e-6 per sample): the causal code2wav
re-reads its left context at every chunk boundary."""

from __future__ import annotations

from typing import Any

import numpy as np
from qwen3_utils import assert_nothing_held, chat_ids

from omnistage.sampling_params import SamplingParams

SP = SamplingParams(temperature=0.0, max_tokens=8)


def test_streamed_audio_equals_the_whole_decode(make_q3: Any) -> None:
    # 16 codes: the stream schedule (4, then 12 frames) makes at least two chunks.
    llm = make_q3(
        talker_params={"temperature": 0.0, "repetition_penalty": 1.0, "max_tokens": 16}
    )
    prompt = {
        "prompt_token_ids": chat_ids(
            llm.get_tokenizer(), "tell me a story about a fox and a dog"
        )
    }
    (whole,) = llm.generate([prompt], SP, use_tqdm=False)
    talker = llm.llm_engine.stages["talker"]
    events, talker_busy_at_chunk = [], []
    for event in llm.generate_stream([prompt], SP):
        if event.new_audio_chunks:
            talker_busy_at_chunk.append(talker.has_unfinished_requests())
        events.append(event)
    final = events[-1].output
    assert (
        events[-1].finished
        and final.extra["codec_frames"] == whole.extra["codec_frames"]
    )
    chunks = [c for e in events for c in e.new_audio_chunks]
    assert (
        len(chunks) >= 2 and talker_busy_at_chunk[0]
    )  # the first chunk left long before the last code
    joined = np.concatenate(chunks)
    assert joined.dtype == np.float32 and joined.shape == whole.audio.shape
    np.testing.assert_allclose(joined, whole.audio, rtol=0, atol=1e-6)
    np.testing.assert_allclose(final.audio, whole.audio, rtol=0, atol=1e-6)
    assert_nothing_held(llm)


def test_leaving_the_stream_early_frees_everything(make_q3: Any) -> None:
    llm = make_q3(
        talker_params={"temperature": 0.0, "repetition_penalty": 1.0, "max_tokens": 16}
    )
    prompt = {
        "prompt_token_ids": chat_ids(
            llm.get_tokenizer(), "tell me a story about a fox and a dog"
        )
    }
    for event in llm.generate_stream([prompt], SP):
        if event.new_audio_chunks:
            break  # mid-speech: the talker and the vocoder still hold the request
    for _ in range(4):  # every stage drops its last rows one step after the abort
        llm.llm_engine.step()
    assert_nothing_held(llm)
