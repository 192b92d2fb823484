"""Qwen3-Omni through omnistage equals transformers' ``generate`` on the tiny checkpoint.

Greedy everywhere (thinker, talker and code predictor; the vocoder draws no
noise): thinker tokens, the codes of every code group, and the waveform are
compared exactly, with a text prompt, an audio prompt, a second voice, and as
a row of a left-padded transformers batch.
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import pytest
import torch
from qwen3_utils import assert_nothing_held, chat_ids, frames_of, hf_generate

from omnistage.engine.omni.stage_io import TalkerParams
from omnistage.sampling_params import SamplingParams

MAX_TEXT, MAX_CODES = 8, 10


@pytest.fixture(scope="module")
def llm(make_q3: Any) -> Any:
    return make_q3()


def _ours(llm: Any, prompt: Any, **kwargs: Any) -> Any:
    out = llm.generate(
        [prompt],
        SamplingParams(temperature=0.0, max_tokens=MAX_TEXT),
        use_tqdm=False,
        **kwargs,
    )[0]
    assert out.error is None
    return out


def _assert_equal(out: Any, ref: tuple[list[int], np.ndarray, np.ndarray]) -> None:
    tokens, codes, wav = ref
    assert list(out.outputs[0].token_ids) == tokens
    assert (
        frames_of(out).shape == codes.shape
        and codes.shape[0] == 4
        and codes.shape[1] > 2
    )
    np.testing.assert_array_equal(frames_of(out), codes)
    assert (
        out.audio.dtype == np.float32
        and out.audio.ndim == 1
        and out.audio.shape == wav.shape
    )
    np.testing.assert_allclose(out.audio, wav, rtol=0, atol=1e-6)
    assert out.sample_rate == 24000 and np.abs(out.audio).max() > 1e-3


@pytest.mark.parametrize("speaker", ["Ethan", "Chelsie"])
def test_text_prompt_equals_transformers(llm: Any, q3_hf: Any, speaker: str) -> None:
    tok = llm.get_tokenizer()
    ids = chat_ids(tok, "tell me about foxes")
    out = _ours(llm, {"prompt_token_ids": ids}, speaker=speaker)
    _assert_equal(
        out, hf_generate(q3_hf, tok, ids, MAX_TEXT, MAX_CODES, speaker=speaker)
    )
    assert_nothing_held(llm)


def test_audio_prompt_equals_transformers(llm: Any, q3_hf: Any, q3_dir: Any) -> None:
    from transformers import AutoFeatureExtractor

    tok = llm.get_tokenizer()
    wave = (0.1 * np.sin(np.arange(16000) * 2 * np.pi * 220 / 16000)).astype(np.float32)
    messages = [
        {
            "role": "user",
            "content": [{"type": "audio"}, {"type": "text", "text": "what is it?"}],
        }
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    out = _ours(llm, {"prompt": text, "multi_modal_data": {"audio": (wave, 16000)}})
    ids = list(out.prompt_token_ids)
    assert (
        ids.count(q3_hf.config.thinker_config.audio_token_id) > 1
    )  # the placeholder was expanded
    fe = AutoFeatureExtractor.from_pretrained(q3_dir)
    feats = fe(
        [wave],
        sampling_rate=16000,
        padding="max_length",
        return_attention_mask=True,
        return_tensors="pt",
    )
    ref = hf_generate(q3_hf, tok, ids, MAX_TEXT, MAX_CODES, input_features=feats["input_features"],
                      feature_attention_mask=feats["attention_mask"])  # fmt: skip
    _assert_equal(out, ref)


def test_equals_a_row_of_a_left_padded_transformers_batch(llm: Any, q3_hf: Any) -> None:
    """transformers' batched path (attention mask, left padding, per-row EOS
    handling) gives each row what omnistage gives that request alone, here
    with both requests in one omnistage batch too."""
    tok = llm.get_tokenizer()
    short, long = chat_ids(tok, "hi"), chat_ids(tok, "tell me a long story about a fox")
    width = len(long)
    pad = tok.pad_token_id
    batch = torch.tensor([[pad] * (width - len(short)) + short, long])
    mask = torch.tensor([[0] * (width - len(short)) + [1] * len(short), [1] * width])
    torch.manual_seed(0)
    seq, wavs = q3_hf.generate(
        input_ids=batch, attention_mask=mask, thinker_max_new_tokens=MAX_TEXT, thinker_do_sample=False,
        thinker_eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), talker_do_sample=False,
        talker_repetition_penalty=1.0, talker_max_new_tokens=MAX_CODES,
    )  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": short}, {"prompt_token_ids": long}],
                        SamplingParams(temperature=0.0, max_tokens=MAX_TEXT), use_tqdm=False)  # fmt: skip
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    for row, out in enumerate(outs):
        tokens = seq[row, width:].tolist()
        if eos in tokens:
            tokens = tokens[: tokens.index(eos) + 1]
        assert list(out.outputs[0].token_ids) == tokens
        np.testing.assert_allclose(out.audio, wavs[row].numpy(), rtol=0, atol=1e-5)


def test_talker_defaults_are_transformers_generate_defaults(
    llm: Any, q3_hf: Any
) -> None:
    sig = inspect.signature(type(q3_hf).generate).parameters
    tc = q3_hf.config.talker_config
    params = TalkerParams.qwen3_defaults(tc)
    assert params.temperature == sig["talker_temperature"].default
    assert (
        params.top_k == sig["talker_top_k"].default
        and params.top_p == sig["talker_top_p"].default
    )
    assert params.repetition_penalty == sig["talker_repetition_penalty"].default
    assert params.max_tokens == sig["talker_max_new_tokens"].default
    assert params.stop_token_ids == (tc.codec_eos_token_id,)
    vocab = tc.text_config.vocab_size
    assert set(params.suppress_token_ids) == set(range(vocab - 1024, vocab)) - {
        tc.codec_eos_token_id
    }
    assert llm.llm_engine.default_speaker == sig["speaker"].default


def test_sampling_talker_is_seeded_and_speaks(make_q3: Any) -> None:
    """With transformers' sampling defaults the talker and code predictor draw from
    the request's seed: the same seed repeats itself, another seed differs."""
    llm = make_q3(talker_params={"max_tokens": 10})
    tok = llm.get_tokenizer()
    ids = chat_ids(tok, "tell me about foxes")

    def run(seed: int) -> Any:
        return llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=MAX_TEXT,
                                                                       seed=seed), use_tqdm=False)[0]  # fmt: skip

    a, b, c = run(1), run(1), run(2)
    assert a.extra["codec_frames"] == b.extra["codec_frames"] and np.array_equal(
        a.audio, b.audio
    )
    assert a.extra["codec_frames"] != c.extra["codec_frames"]
    assert_nothing_held(llm)


IMAGE_PROMPT = "<|im_start|>user\nlook at this picture <|vision_start|><|image_pad|><|vision_end|>what is it?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def image() -> Any:
    from PIL import Image

    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 255, (96, 128, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def image_reference(
    llm: Any, q3_hf: Any, q3_dir: Any, image: Any
) -> tuple[list[int], Any]:
    """(prompt ids as omnistage expands them, transformers' answer): deepstack rows included."""
    from transformers import AutoImageProcessor

    out = _ours(llm, {"prompt": IMAGE_PROMPT, "multi_modal_data": {"image": image}})
    ids = list(out.prompt_token_ids)
    pixels = AutoImageProcessor.from_pretrained(q3_dir, backend="pil")(
        images=[image], return_tensors="pt"
    )
    tok = llm.get_tokenizer()
    ref = hf_generate(q3_hf, tok, ids, MAX_TEXT, MAX_CODES, pixel_values=pixels["pixel_values"],
                      image_grid_thw=pixels["image_grid_thw"])  # fmt: skip
    return ids, ref


@pytest.mark.parametrize(
    "chunk", [None, 16], ids=["whole-prefill", "chunked-prefill-16"]
)
def test_image_prompt_equals_transformers(
    make_q3: Any, image: Any, image_reference: Any, chunk: int | None
) -> None:
    """The image's deepstack rows enter the first decoder layers at its positions, also
    when a prefill chunk ends inside the image (the cache then serves slices of it)."""
    llm = make_q3(**({} if chunk is None else {"max_num_batched_tokens": chunk}))
    ids, ref = image_reference
    assert (
        ids.count(llm.llm_engine.loaded_model.hf_config.thinker_config.image_token_id)
        > 4
    )
    adapter = llm.llm_engine.stages["thinker"].runner.mm_adapter
    steps: list[int] = []  # image rows with deepstack rows, per thinker step
    begin = adapter.begin_step

    def spy(rows: Any, mask: Any) -> None:
        begin(rows, mask)
        steps.append(
            0 if adapter._step_deepstack is None else adapter._step_deepstack[0].numel()
        )

    adapter.begin_step = spy
    out = _ours(llm, {"prompt": IMAGE_PROMPT, "multi_modal_data": {"image": image}})
    assert list(out.prompt_token_ids) == ids
    _assert_equal(out, ref)
    assert len([n for n in steps if n]) == (
        1 if chunk is None else 2
    )  # the image split over two chunks
    assert_nothing_held(llm)


VIDEO_PROMPT = "<|im_start|>user\nwatch this <|vision_start|><|video_pad|><|vision_end|>what happens?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def video() -> np.ndarray:
    # 2 frames: one temporal grid; Qwen3-Omni's processor sizes it to at least 128 merged tokens
    # (its fixed video size, whatever the checkpoint's own), here 12 x 12 of them
    return np.random.default_rng(1).integers(0, 255, (2, 32, 32, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def video_reference(llm: Any, q3_hf: Any, q3_dir: Any, video: np.ndarray) -> tuple[list[int], Any]:
    """(prompt ids as omnistage expands them, transformers' answer) for the video prompt,
    transformers given the same pixels, grid and seconds per grid (its video processor
    needs torchvision; ours is checked on its own in tests/multimodal)."""
    from omnistage.multimodal.processing import MultiModalProcessor

    processed = MultiModalProcessor(q3_dir).process(
        {"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": video}}
    )
    (feature,) = processed.mm_features
    data = feature.data
    # transformers' Qwen3-Omni processor: temporal_patch_size / fps, fps 1.0 by default
    assert data["video_grid_thw"].tolist() == [[1, 24, 24]]
    assert data["second_per_grid_ts"].tolist() == [2.0]
    ref = hf_generate(
        q3_hf, llm.get_tokenizer(), processed.prompt_token_ids, MAX_TEXT, MAX_CODES,
        pixel_values_videos=data["pixel_values_videos"], video_grid_thw=data["video_grid_thw"],
        video_second_per_grid=data["second_per_grid_ts"],
    )  # fmt: skip
    return processed.prompt_token_ids, ref


@pytest.mark.parametrize(
    "chunk", [None, 16], ids=["whole-prefill", "chunked-prefill-16"]
)
def test_video_prompt_equals_transformers(
    make_q3: Any, video: np.ndarray, video_reference: Any, chunk: int | None
) -> None:
    """A video through the vision tower and the encoder cache: its M-RoPE positions
    (temporal axis in seconds per grid), its deepstack rows (also when a prefill chunk
    ends inside the video), the talker's positions and the waveform equal transformers'."""
    llm = make_q3(**({} if chunk is None else {"max_num_batched_tokens": chunk}))
    ids, ref = video_reference
    video_id = llm.llm_engine.loaded_model.hf_config.thinker_config.video_token_id
    assert ids.count(video_id) == 144
    adapter = llm.llm_engine.stages["thinker"].runner.mm_adapter
    steps: list[int] = []  # video rows with deepstack rows, per thinker step
    begin = adapter.begin_step

    def spy(rows: Any, mask: Any) -> None:
        begin(rows, mask)
        steps.append(0 if adapter._step_deepstack is None else adapter._step_deepstack[0].numel())

    adapter.begin_step = spy
    out = _ours(llm, {"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": video}})
    assert list(out.prompt_token_ids) == ids
    _assert_equal(out, ref)
    start = ids.index(video_id)
    windows = 1 if chunk is None else (start + 143) // chunk - start // chunk + 1  # prefill windows it spans
    assert sum(steps) == 144 and len([n for n in steps if n]) == windows
    assert_nothing_held(llm)


def test_audio_in_video_is_refused_clearly(llm: Any, video: np.ndarray) -> None:
    with pytest.raises(ValueError, match="use_audio_in_video is not supported"):
        llm.generate(
            [{"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": video},
              "mm_processor_kwargs": {"use_audio_in_video": True}}],
            SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False,
        )  # fmt: skip
    assert_nothing_held(llm)
