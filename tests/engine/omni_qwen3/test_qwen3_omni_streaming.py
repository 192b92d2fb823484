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


def test_concurrent_requests_batched_in_the_vocoder_equal_each_alone(make_q3: Any) -> None:
    """Several requests in flight: the code2wav stage decodes their ready chunks in one
    forward (chunks of different lengths and windows in one batch); each request's
    streamed chunks and whole audio equal the same request run alone."""
    from omnistage.core.chunk_schedule import ChunkSchedule

    talker = {"temperature": 0.0, "repetition_penalty": 1.0, "max_tokens": 16}
    texts = ["tell me a story about a fox and a dog", "hi there", "what is the weather like in paris"]
    sps = [SamplingParams(temperature=0.0, max_tokens=n) for n in (8, 8, 6)]
    batched = make_q3(talker_params=talker)
    stage = batched.llm_engine.stages["token2wav"]
    assert stage.scheduler.max_requests_per_step > 1
    vocoder = stage.runner.model
    prompts = [{"prompt_token_ids": chat_ids(batched.get_tokenizer(), t)} for t in texts]
    batches: list[list[int]] = []  # the sample counts of each batched call's chunks
    original = vocoder.decode_chunks

    def spy(calls: Any) -> Any:
        out = original(calls)
        batches.append([len(a) for a in out])
        return out

    # Chunks of 2 frames: requests that start a step or two apart still share steps.
    vocoder.stream_schedule, vocoder.decode_chunks = ChunkSchedule(first=2, size=2), spy
    try:
        streamed: list[list[np.ndarray]] = [[] for _ in prompts]
        for event in batched.generate_stream(prompts, sps):
            streamed[event.index].extend(event.new_audio_chunks)
        whole = batched.generate(prompts, sps, use_tqdm=False)
        del vocoder.decode_chunks
        alone = make_q3(talker_params=talker, token2wav_requests_per_step=1)
        for i, (prompt, sp) in enumerate(zip(prompts, sps, strict=True)):
            (ref,) = alone.generate([prompt], sp, use_tqdm=False)
            ref_chunks = [c for e in alone.generate_stream([prompt], sp) for c in e.new_audio_chunks]
            assert whole[i].extra["codec_frames"] == ref.extra["codec_frames"] and ref.audio.size > 0
            assert whole[i].audio.shape == ref.audio.shape and len(streamed[i]) == len(ref_chunks) >= 2
            np.testing.assert_allclose(whole[i].audio, ref.audio, rtol=0, atol=1e-6)
            for got, want in zip(streamed[i], ref_chunks, strict=True):
                assert got.shape == want.shape
                np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
            np.testing.assert_allclose(np.concatenate(streamed[i]), ref.audio, rtol=0, atol=1e-6)
    finally:
        vocoder.__dict__.pop("decode_chunks", None)
        del vocoder.stream_schedule
    assert any(len(b) >= 2 and len(set(b)) >= 2 for b in batches), batches  # mixed chunk lengths
    assert_nothing_held(batched)
    assert_nothing_held(alone)
