"""The whole pipeline against transformers' Qwen2.5-Omni, on the same tiny weights.

Thinker tokens and talker codes are compared exactly (greedy), waveforms with
a float tolerance (same codes, same seed).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from omni_utils import assert_same_answer

from omnistage.sampling_params import SamplingParams
from omnistage.testing.hf_reference import (
    handoff_from_hf_generate,
    hf_generate_capturing_stages,
    talker_from_omni_model,
    talker_greedy_codes,
)
from omnistage.testing.tiny_omni_checkpoint import SPEAKER_BOS_TOKEN_IDS


def hf_generate(model: Any, input_ids: list[int], seed: int, **kwargs: Any) -> dict[str, Any]:
    """``model.generate`` with a greedy talker after ``torch.manual_seed(seed)``: the thinker's
    new tokens and result, and the talker's codes of that same call."""
    ids = torch.tensor([input_ids])
    hf = hf_generate_capturing_stages(model, ids, seed, **kwargs)
    return {
        "tokens": hf["sequences"][0, len(input_ids) :].tolist(),
        "codes": hf["codes"],
        "wav": hf["wav"].reshape(-1).numpy(),
        "thinker": hf["thinker"],
        "ids": ids,
    }


def hf_token2wav(model: Any, codes: list[int], speaker: str, seed: int) -> np.ndarray:
    params = model.speaker_map[speaker]
    torch.manual_seed(seed)
    with torch.no_grad():
        wave = model.token2wav(
            torch.tensor([codes]), conditioning=params["cond"].float()[None], reference_mel=params["ref_mel"].float()
        )
    return wave.reshape(-1).numpy()


def assert_wave_close(ours: np.ndarray, ref: np.ndarray) -> None:
    assert ours.dtype == np.float32 and ours.ndim == 1 and ours.shape == ref.shape
    assert np.abs(ref).max() > 0.01  # a real signal
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-6)


CASES = [
    # prompt, speaker, thinker max tokens, talker max codes, repetition penalty, seed
    ("hello there, how are you", "Chelsie", 8, 20, 1.05, 0),
    ("tell me a story", "Ethan", 6, 16, 1.3, 1234),
    ("a b", None, 5, 12, 1.0, 7),
]


@pytest.mark.parametrize(("prompt", "speaker", "max_tokens", "max_codes", "penalty", "seed"), CASES)
def test_equals_transformers_generate(
    make_llm: Any, hf_model: Any, prompt: str, speaker: str | None, max_tokens: int, max_codes: int,
    penalty: float, seed: int,
) -> None:  # fmt: skip
    """transformers 5.24 runs a single unpadded request without the codec
    pad/bos embeddings and M-RoPE (docs/omni_pipeline.md, quirk 2); the
    pipeline reproduces that path on request."""
    llm = make_llm(
        seed=seed,
        talker_match_transformers_unpadded=True,
        talker_params={"temperature": 0.0, "max_tokens": max_codes, "repetition_penalty": penalty},
    )
    ids = llm.get_tokenizer()(prompt).input_ids
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=max_tokens), speaker=speaker)[0]
    hf = hf_generate(
        hf_model, ids, seed, speaker=speaker or "Chelsie", thinker_max_new_tokens=max_tokens,
        talker_max_new_tokens=max_codes, talker_repetition_penalty=penalty,
    )  # fmt: skip
    assert out.outputs[0].token_ids == hf["tokens"]
    assert out.extra["codec_token_ids"] == hf["codes"] and hf["codes"]
    assert out.sample_rate == 24000 and isinstance(out.sample_rate, int)
    assert_wave_close(out.audio, hf["wav"])


def test_image_prompt_equals_transformers_generate(make_llm: Any, hf_model: Any) -> None:
    from PIL import Image

    llm = make_llm(talker_match_transformers_unpadded=True, talker_params={"temperature": 0.0, "max_tokens": 16})
    pixels = (np.random.default_rng(0).random((56, 56, 3)) * 255).astype(np.uint8)
    prompt = {
        "prompt": "look <|vision_bos|><|IMAGE|><|vision_eos|> what?",
        "multi_modal_data": {"image": Image.fromarray(pixels)},
    }
    inputs = llm.llm_engine.stages["thinker"].process_inputs("probe", prompt)
    (image,) = inputs.mm_features
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5))[0]
    hf = hf_generate(
        hf_model, inputs.prompt_token_ids, 0, thinker_max_new_tokens=5, talker_max_new_tokens=16,
        thinker_pixel_values=image.data["pixel_values"], image_grid_thw=image.data["image_grid_thw"],
    )  # fmt: skip
    assert out.outputs[0].token_ids == hf["tokens"]
    assert out.extra["codec_token_ids"] == hf["codes"]
    assert_wave_close(out.audio, hf["wav"])


@pytest.mark.parametrize("use_image", [False, True])
def test_default_talker_equals_reference_on_transformers_handoff(
    make_llm: Any, hf_model: Any, use_image: bool
) -> None:
    """The default talker (codec pad/bos embeddings in the prefill, M-RoPE
    positions) on the paged engine gives the codes of ``talker_greedy_codes``,
    which tests/models checks against HF's talker forward with a mask."""
    from PIL import Image

    llm = make_llm(talker_params={"temperature": 0.0, "max_tokens": 16, "repetition_penalty": 1.05})
    if use_image:
        pixels = (np.random.default_rng(1).random((56, 84, 3)) * 255).astype(np.uint8)
        prompt: Any = {
            "prompt": "see <|vision_bos|><|IMAGE|><|vision_eos|> and say",
            "multi_modal_data": {"image": Image.fromarray(pixels)},
        }
    else:
        prompt = "tell me something"
    inputs = llm.llm_engine.stages["thinker"].process_inputs("probe", prompt)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6), speaker="Ethan")[0]
    mm: dict[str, Any] = {}
    grids: dict[str, Any] = {}
    if use_image:
        (image,) = inputs.mm_features
        mm = {"pixel_values": image.data["pixel_values"], "image_grid_thw": image.data["image_grid_thw"]}
        grids = {"image_grid_thw": image.data["image_grid_thw"]}
    ids = torch.tensor([inputs.prompt_token_ids])
    result = hf_model.thinker.generate(
        ids, max_new_tokens=6, output_hidden_states=True, return_dict_in_generate=True, **mm
    )
    assert out.outputs[0].token_ids == result.sequences[0, ids.shape[1] :].tolist()
    handoff = handoff_from_hf_generate(hf_model, ids, result, **grids)
    reference = talker_from_omni_model(hf_model)
    codes = talker_greedy_codes(reference, handoff, SPEAKER_BOS_TOKEN_IDS["Ethan"], 16, repetition_penalty=1.05)
    assert out.extra["codec_token_ids"] == codes and codes
    assert_wave_close(out.audio, hf_token2wav(hf_model, codes, "Ethan", seed=0))


def test_continuous_batching_equals_one_at_a_time(make_llm: Any) -> None:
    """Several requests through every stage together (different lengths, so
    they finish each stage at different steps) give what each gives alone."""
    prompts = ["hello there, how are you", "a b", "tell me a story about the sea"]
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in (8, 5, 7)]
    batched = make_llm().generate(prompts, params)
    alone = make_llm()
    for prompt, sp, together in zip(prompts, params, batched):
        assert_same_answer(together, alone.generate([prompt], sp)[0])


def test_talker_preemption_and_chunked_prefill_keep_codes(make_llm: Any) -> None:
    """A talker pool too small for all requests at once preempts (the resumed
    request re-counts its codes for the repetition penalty); a small token
    budget chunks the talker's prefill. Codes equal those of a roomy talker."""
    prompts = ["hello there, how are you", "tell me a story about the sea", "what is up with you"]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    talker = {"temperature": 0.0, "max_tokens": 8, "repetition_penalty": 1.3}
    roomy = make_llm(talker_params=talker).generate(prompts, params)
    tight = make_llm(talker_params=talker, talker_num_kv_blocks=22, max_num_batched_tokens=16)
    outs = tight.generate(prompts, params)
    assert tight.llm_engine.stages["talker"].scheduler.num_preemptions > 0
    for ours, ref in zip(outs, roomy):
        assert_same_answer(ours, ref)
