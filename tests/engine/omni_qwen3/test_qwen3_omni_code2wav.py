"""Qwen3-Omni's code2wav: the full decode equals transformers', and chunked decodes
with left context concatenate to it exactly, for any chunk schedule.

Both peers shipped streams that lost samples at every chunk boundary
(vllm-omni #4706, sglang-omni #1354); transformers' own ``chunked_decode``
does too (it cuts ``context * 1920`` samples where ``context * 1920 - 555``
belong to earlier chunks). Every boundary here is checked for that.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from omnistage.models.qwen3_omni_code2wav import Qwen3OmniCode2Wav

transformers = pytest.importorskip("transformers")

NUM_FRAMES = 37


@pytest.fixture(scope="module")
def vocoder(q3_hf: Any) -> Qwen3OmniCode2Wav:
    return Qwen3OmniCode2Wav(q3_hf.code2wav)


@pytest.fixture(scope="module")
def codes() -> np.ndarray:
    return torch.randint(
        0, 64, (4, NUM_FRAMES), generator=torch.Generator().manual_seed(0)
    ).numpy()


@pytest.fixture(scope="module")
def full(vocoder: Qwen3OmniCode2Wav, codes: np.ndarray) -> np.ndarray:
    return vocoder.decode(codes)


def test_full_decode_equals_transformers(
    q3_hf: Any, vocoder: Qwen3OmniCode2Wav, codes: np.ndarray, full: np.ndarray
) -> None:
    with torch.inference_mode():
        ref = q3_hf.code2wav.chunked_decode(
            torch.from_numpy(codes)[None], chunk_size=300, left_context_size=25
        )
    ref = ref.reshape(-1).float().numpy()
    assert full.dtype == np.float32 and full.shape == ref.shape == (
        vocoder.num_samples(NUM_FRAMES),
    )
    assert full.shape[0] == NUM_FRAMES * 1920 - vocoder.trim and vocoder.trim == 555
    np.testing.assert_array_equal(full, ref)
    assert np.abs(full).max() > 1e-2  # audible, so the comparisons mean something


def _schedules() -> list[list[int]]:
    return [
        [1] * NUM_FRAMES,  # a boundary after every frame
        [2, 5, 30],  # small first chunk for latency, larger later
        [1, 4, 8, 8, 16],
        [NUM_FRAMES - 1, 1],
        [21, 16],  # the first boundary exactly at left_context
        [NUM_FRAMES],
    ]


@pytest.mark.parametrize(
    "schedule", _schedules(), ids=lambda s: "-".join(map(str, s[:6]))
)
def test_stream_equals_full_decode(vocoder: Qwen3OmniCode2Wav, codes: np.ndarray, full: np.ndarray,
                                   schedule: list[int]) -> None:  # fmt: skip
    assert sum(schedule) == NUM_FRAMES
    stream = vocoder.stream()
    parts, start = [], 0
    for n in schedule:
        part = stream.push(codes[:, start : start + n])
        start += n
        # Each chunk ends exactly where the full decode of the frames so far ends: no gap, no overlap.
        assert stream.num_samples == vocoder.num_samples(start)
        np.testing.assert_allclose(
            part,
            full[stream.num_samples - part.shape[0] : stream.num_samples],
            rtol=0,
            atol=1e-6,
        )
        parts.append(part)
    joined = np.concatenate(parts)
    assert joined.dtype == np.float32 and joined.shape == full.shape
    np.testing.assert_allclose(joined, full, rtol=0, atol=1e-6)


def test_decode_codes_with_a_later_window(
    vocoder: Qwen3OmniCode2Wav, codes: np.ndarray, full: np.ndarray
) -> None:
    """A window that starts past frame 0 (frames 10..36, 21 of them context)."""
    c = vocoder.left_context
    part = vocoder.decode_codes(codes[:, 10:], left_context=c, first_frame=10)
    lo = vocoder.num_samples(10 + c)
    assert part.shape == (full.shape[0] - lo,)
    np.testing.assert_allclose(part, full[lo:], rtol=0, atol=1e-6)


def test_too_little_left_context_is_not_exact(
    vocoder: Qwen3OmniCode2Wav, codes: np.ndarray, full: np.ndarray
) -> None:
    """The context the vocoder asks for is needed: with far less the chunk differs
    (so the equality above is not trivially true)."""
    e0, c = 30, 2
    part = vocoder.decode_codes(codes[:, e0 - c :], left_context=c, first_frame=e0 - c)
    lo = vocoder.num_samples(e0)
    assert part.shape == (full.shape[0] - lo,)
    assert np.abs(part - full[lo:]).max() > 1e-4


def test_transformers_chunked_decode_drops_samples_at_boundaries(
    q3_hf: Any, full: np.ndarray, codes: np.ndarray
) -> None:
    with torch.inference_mode():
        chunked = q3_hf.code2wav.chunked_decode(
            torch.from_numpy(codes)[None], chunk_size=10, left_context_size=25
        )
    num_chunks = -(-NUM_FRAMES // 10)
    assert full.shape[0] - chunked.shape[-1] == 555 * (num_chunks - 1)


def test_batch_decode_equals_single_decodes(
    vocoder: Qwen3OmniCode2Wav, codes: np.ndarray, full: np.ndarray
) -> None:
    batch = vocoder.decode_batch([codes[:, :5], codes, codes[:, :0], codes[:, :20]])
    assert [b.shape[0] for b in batch] == [
        vocoder.num_samples(n) for n in (5, NUM_FRAMES, 0, 20)
    ]
    np.testing.assert_allclose(batch[1], full, rtol=0, atol=1e-6)
    for got, n in ((batch[0], 5), (batch[3], 20)):
        np.testing.assert_allclose(got, vocoder.decode(codes[:, :n]), rtol=0, atol=1e-6)


def test_bad_codes_are_refused(vocoder: Qwen3OmniCode2Wav, codes: np.ndarray) -> None:
    with pytest.raises(ValueError, match="expected codes"):
        vocoder.decode(codes[:3])
    with pytest.raises(ValueError, match="left_context"):
        vocoder.decode_codes(codes[:, :4], left_context=5)
    # A control id past the codebook (group 0 here) would read another group's embedding, or none.
    for bad in (vocoder.codebook_size, -1):
        past = codes.copy()
        past[0, 3] = bad
        with pytest.raises(ValueError, match=rf"codes must be in \[0, {vocoder.codebook_size}\)"):
            vocoder.decode_batch([codes, past])


def test_frames_streamed_while_the_talker_speaks_equal_the_final_audio(
    make_q3: Any,
) -> None:
    """Push ``speakable_frames`` to a stream after every pipeline step: the audio
    arrives in several chunks before the request ends, and their concatenation is the
    request's final waveform."""
    from qwen3_utils import chat_ids

    from omnistage.sampling_params import SamplingParams

    llm = make_q3(
        talker_params={"temperature": 0.0, "repetition_penalty": 1.0, "max_tokens": 14}
    )
    pipeline = llm.llm_engine
    vocoder = pipeline.stages["token2wav"].runner.model
    stream, pushed, chunks, done = vocoder.stream(), 0, [], []
    ids = chat_ids(llm.get_tokenizer(), "tell me a story about a fox and a dog")
    pipeline.add_request(
        "r", {"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=8)
    )
    while pipeline.has_unfinished_requests():
        frames = pipeline.speakable_frames("r")
        new = frames[pushed:]
        outs = [o for o in pipeline.step() if o.finished]
        if new and not done:
            chunks.append(stream.push(np.asarray(new).T))
            pushed += len(new)
        done.extend(outs)
    (out,) = done
    final = out.extra["codec_frames"]
    if pushed < len(final):
        chunks.append(stream.push(np.asarray(final[pushed:]).T))
    assert len([c for c in chunks if c.size]) >= 2
    joined = np.concatenate(chunks)
    assert joined.shape == out.audio.shape
    np.testing.assert_allclose(joined, out.audio, rtol=0, atol=1e-6)


@pytest.mark.parametrize("schedule", [(4, 12), (1, 1), (2, 5), (21, 3), None], ids=str)
def test_chunked_vocoder_protocol_equals_full_decode(
    q3_hf: Any, codes: np.ndarray, full: np.ndarray, schedule: tuple[int, int] | None
) -> None:
    """As the chunked vocoder stage drives it (``decode_in_chunks``: each chunk decoded
    as soon as its frames exist, seeing only those), for several schedules and the
    whole decode (``stream=False``)."""
    from omnistage.core.chunk_schedule import ChunkSchedule
    from omnistage.models.chunked_vocoder import ChunkedVocoder, decode_in_chunks

    vocoder = Qwen3OmniCode2Wav(q3_hf.code2wav)
    assert isinstance(vocoder, ChunkedVocoder)
    if schedule is not None:
        vocoder.stream_schedule = ChunkSchedule(first=schedule[0], size=schedule[1])
    chunks = decode_in_chunks(
        vocoder, codes.T.tolist(), "Ethan", 0, stream=schedule is not None
    )
    expected = (
        1 if schedule is None else vocoder.stream_schedule.num_ready(NUM_FRAMES, True)
    )
    assert len(chunks) == expected and (schedule is None or expected > 2)
    joined = np.concatenate(chunks)
    assert joined.shape == full.shape
    np.testing.assert_allclose(joined, full, rtol=0, atol=1e-6)


def test_batched_chunks_equal_one_chunk_at_a_time(vocoder: Qwen3OmniCode2Wav) -> None:
    """``decode_chunks``: chunks of different requests, lengths, windows and first frames
    (a first chunk, a middle one with full left context, a last short one, an empty
    last one) in one padded forward give each chunk's own samples, same length."""
    from omnistage.core.chunk_schedule import ChunkSchedule
    from omnistage.models.chunked_vocoder import ChunkCall

    gen = torch.Generator().manual_seed(1)
    frames = [torch.randint(0, 64, (n, 4), generator=gen).tolist() for n in (37, 9, 30, 5, 16)]
    s412, s25, whole = ChunkSchedule(first=4, size=12), ChunkSchedule(first=2, size=5), ChunkSchedule()
    calls = [
        ChunkCall(frames[0], 2, s412, False),  # frames 16..28 after 16 frames of context
        ChunkCall(frames[1][:4], 0, s412, False),  # a first chunk of 4
        ChunkCall(frames[2], 5, s25, True),  # the last, 3 frames after 21 of context
        ChunkCall(frames[3], 0, whole, True),  # a whole decode
        ChunkCall(frames[4], 1, s412, True),  # the last, 12 frames
    ]
    batched = vocoder.decode_chunks(calls)
    for call, got in zip(calls, batched, strict=True):
        alone = vocoder.decode_chunk(call.codes, call.index, call.state, call.last)
        assert got.dtype == np.float32 and got.shape == alone.shape and alone.size > 0
        np.testing.assert_allclose(got, alone, rtol=0, atol=1e-6)
    assert {len(b) for b in batched} != {len(batched[0])}  # lengths really differ
