"""Streaming speech: the chunk schedule, Qwen2.5-Omni's chunked token2wav at its
chunk boundaries (real tiny weights), and the pipeline's audio that leaves
while the talker still speaks."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from omni_utils import assert_nothing_held, run_until_idle

from omnistage import LLM
from omnistage.core.chunk_schedule import ChunkSchedule
from omnistage.models.chunked_vocoder import ChunkedVocoder, decode_in_chunks
from omnistage.models.qwen2_5_omni import OmniModel
from omnistage.models.qwen2_5_omni_token2wav import (
    DiTStreamConfig,
    Qwen2_5OmniToken2Wav,
)
from omnistage.sampling_params import SamplingParams

SPEAKER, SEED = "Chelsie", 3
HOP = 240  # samples per mel frame; 2 mel frames per code
PROMPT = "Hello there, say hi."
SP = SamplingParams(temperature=0.0, max_tokens=8, seed=5)
TWELVE_CODES = {"temperature": 0.0, "max_tokens": 12}  # a dozen codec frames: two chunks of the tiny schedule


def _codes(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 40, n).tolist()  # inside the tiny codec vocabulary


def _token2wav(omni: OmniModel, config: DiTStreamConfig | None = None) -> Qwen2_5OmniToken2Wav:
    """The checkpoint's token2wav (shared weights) with its own streaming config."""
    shared = omni.token2wav
    return Qwen2_5OmniToken2Wav(shared.token2wav, shared.speakers, config)


# -- the schedule --------------------------------------------------------------------


@pytest.mark.parametrize(
    "schedule", [ChunkSchedule(6, 6, 2), ChunkSchedule(1, 4, 0), ChunkSchedule(2, 5, 3), ChunkSchedule()]
)
def test_chunks_tile_the_codes_and_early_chunks_never_change(schedule: ChunkSchedule) -> None:
    for n in range(30):
        total = schedule.num_ready(n, True)
        spans = [schedule.span(i, n, i == total - 1) for i in range(total)]
        if n == 0:
            assert spans == []
            continue
        assert spans[0][0] == 0 and spans[-1][1] == n and all(s < e for s, e in spans)
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
        ready_before = 0
        for known in range(n + 1):  # the codes arrive one by one: a chunk decoded early is never the last
            ready = schedule.num_ready(known, False)
            assert ready_before <= ready <= total - 1
            for i in range(ready):
                assert schedule.span(i, known, False) == spans[i]
                assert known >= spans[i][1] + schedule.lookahead
            ready_before = ready


def test_the_token2wav_is_a_chunked_vocoder_with_the_authors_schedule(omni_model: OmniModel) -> None:
    token2wav = omni_model.token2wav
    assert isinstance(token2wav, ChunkedVocoder)
    # Tiny DiT blocks of 4 mel frames: chunks of 3 blocks (6 codes), 1 block (2 codes) of look-ahead.
    assert token2wav.chunk_schedule(True) == ChunkSchedule(first=6, size=6, lookahead=2)
    assert token2wav.chunk_schedule(False) == ChunkSchedule()
    assert (token2wav.past_frames, token2wav.vocoder_context) == (8, 3)
    with pytest.raises(ValueError, match="unknown speaker 'Nobody'"):
        token2wav.start_decode("Nobody", SEED, True)


# -- the chunked token2wav ----------------------------------------------------------


@pytest.mark.parametrize("n", [1, 6])
def test_a_stream_of_one_chunk_is_the_whole_decode(omni_model: OmniModel, n: int) -> None:
    codes = _codes(n)
    (chunk,) = decode_in_chunks(omni_model.token2wav, codes, SPEAKER, SEED)
    assert np.array_equal(chunk, omni_model.token2wav(codes, SPEAKER, seed=SEED))


@pytest.mark.parametrize("n", [11, 20, 21])
def test_chunk_boundaries_drop_and_repeat_no_sample(omni_model: OmniModel, n: int) -> None:
    """With a DiT window that sees every code and BigVGAN context wider than its
    receptive field, the chunk machinery alone is left: the stream must then be
    the whole decode, in length and to 1e-6 per sample, at every boundary."""
    wide = DiTStreamConfig(chunk_blocks=5, past_blocks=100, future_blocks=100, vocoder_context_frames=10)
    token2wav = _token2wav(omni_model, wide)
    codes = _codes(n, seed=n)
    chunks = decode_in_chunks(token2wav, codes, SPEAKER, SEED)
    full = token2wav(codes, SPEAKER, seed=SEED)
    stream = np.concatenate(chunks)
    assert stream.shape == full.shape == (480 * n,)
    chunk, ctx = token2wav.chunk_frames, token2wav.vocoder_context
    frames = [chunk - ctx] + [chunk] * (len(chunks) - 2) + [2 * n - (len(chunks) - 1) * chunk + ctx]
    assert len(chunks) >= 2 and [c.shape[0] for c in chunks] == [f * HOP for f in frames]
    assert np.abs(stream - full).max() < 1e-6


@pytest.mark.parametrize("n", [19])
def test_authors_schedule_keeps_the_length_and_stays_close(omni_model: OmniModel, n: int) -> None:
    """The authors' window (2 blocks back, 1 ahead, 3 frames of BigVGAN context
    on the tiny blocks) is not the whole decode: same length, close samples
    (SNR over 30 dB; docs/omni_pipeline.md has the numbers), and each chunk
    depends only on the codes and the seed, never on when the codes arrived."""
    token2wav = omni_model.token2wav
    codes = _codes(n, seed=100 + n)
    one_by_one = decode_in_chunks(token2wav, codes, SPEAKER, SEED)
    state = token2wav.start_decode(SPEAKER, SEED, True)  # all codes known (and final) at once
    total = token2wav.chunk_schedule(True).num_ready(n, True)
    at_once = [token2wav.decode_chunk(codes, i, state, last=i == total - 1) for i in range(total)]
    assert len(one_by_one) == total >= 2
    assert all(np.array_equal(a, b) for a, b in zip(one_by_one, at_once))
    stream, full = np.concatenate(one_by_one), token2wav(codes, SPEAKER, seed=SEED)
    assert stream.shape == full.shape
    snr = 10 * np.log10(np.sum(full.astype(np.float64) ** 2) / np.sum((stream - full).astype(np.float64) ** 2))
    assert snr > 30, snr


# -- the pipeline ----------------------------------------------------------------------


def test_generate_stream_speaks_while_the_talker_runs(make_llm: Callable[..., LLM]) -> None:
    llm = make_llm(talker_params=TWELVE_CODES)
    talker = llm.llm_engine.stages["talker"]
    arrivals: list[tuple[int, bool]] = []  # (samples, talker still running) per audio chunk
    final = None
    for event in llm.generate_stream(PROMPT, SP):
        arrivals += [(c.shape[0], talker.get_num_unfinished_requests() > 0) for c in event.new_audio_chunks]
        if event.finished:
            final = event.output
    assert final is not None
    codes = final.extra["codec_token_ids"]
    assert len(codes) == 12
    assert len(arrivals) >= 2 and arrivals[0][1] and not arrivals[-1][1]  # the first while the talker speaks
    want = decode_in_chunks(llm.llm_engine.stages["token2wav"].loaded_model.model, codes, SPEAKER, SP.seed)
    assert [a for a, _ in arrivals] == [w.shape[0] for w in want]
    assert np.array_equal(final.audio, np.concatenate(want))
    assert all(np.array_equal(a, b) for a, b in zip(final.audio_chunks, want))
    (whole,) = llm.generate(PROMPT, SP)  # generate keeps the whole decode (which equals transformers)
    assert whole.extra["codec_token_ids"] == codes and len(whole.audio_chunks) == 1
    assert np.array_equal(whole.audio, llm.llm_engine.stages["token2wav"].loaded_model.model(codes, SPEAKER, seed=5))
    assert_nothing_held(llm)


def test_leaving_the_stream_aborts_the_request_in_the_vocoder(make_llm: Callable[..., LLM]) -> None:
    llm = make_llm(talker_params=TWELVE_CODES)
    vocoder = llm.llm_engine.stages["token2wav"]
    held_at_first_chunk: Any = None
    for event in llm.generate_stream([PROMPT, "another prompt"], SP):
        if event.new_audio_chunks and not event.finished:
            held_at_first_chunk = vocoder.held()
            break  # GeneratorExit: the generator aborts what is still running
    assert held_at_first_chunk is not None and held_at_first_chunk.payloads >= 1  # its decode state was held
    assert not llm.llm_engine.has_unfinished_requests() or run_until_idle(llm) == []
    assert_nothing_held(llm)
    (again,) = [e.output for e in llm.generate_stream(PROMPT, SP) if e.finished]  # the engine serves on
    assert len(again.audio_chunks) >= 2


def test_a_failing_chunk_fails_its_request_alone(make_llm: Callable[..., LLM], monkeypatch: pytest.MonkeyPatch) -> None:
    """The second chunk's decode raises: the request ends with the error after its
    first chunk left, every stage lets go of it, and the next stream is whole."""
    llm = make_llm(talker_params=TWELVE_CODES)
    token2wav = llm.llm_engine.stages["token2wav"].loaded_model.model
    real = token2wav.decode_chunk

    def decode_chunk(codes: Any, index: int, state: Any, last: bool) -> np.ndarray:
        if index == 1:
            raise RuntimeError("injected vocoder failure")
        return real(codes, index, state, last)

    monkeypatch.setattr(token2wav, "decode_chunk", decode_chunk)
    got: list[int] = []
    with pytest.raises(RuntimeError, match="injected vocoder failure"):
        for event in llm.generate_stream(PROMPT, SP):
            got += [c.shape[0] for c in event.new_audio_chunks]
    assert len(got) == 1  # the first chunk had left
    run_until_idle(llm)
    assert_nothing_held(llm)
    monkeypatch.setattr(token2wav, "decode_chunk", real)
    (again,) = [e.output for e in llm.generate_stream(PROMPT, SP) if e.finished]
    assert len(again.audio_chunks) >= 2 and again.audio.shape == (480 * 12,)
