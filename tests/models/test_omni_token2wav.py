"""Qwen2.5-Omni token2wav stage against transformers, on the tiny whole checkpoint."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from omnistage.models.qwen2_5_omni_token2wav import Qwen2_5OmniToken2Wav
from omnistage.testing.hf_reference import (
    handoff_from_hf_generate,
    talker_from_omni_model,
    talker_greedy_codes,
    token2wav_from_omni_model,
)
from omnistage.testing.tiny_omni_checkpoint import (
    SAMPLE_RATE,
    SPEAKER_BOS_TOKEN_IDS,
    TALKER_EOS_TOKEN_IDS,
    write_tiny_qwen2_5_omni,
)

transformers = pytest.importorskip("transformers")

CODES = [53, 35, 56, 43, 58, 7, 7, 7, 46, 46, 29, 16, 5]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    transformers.logging.set_verbosity_error()
    path = write_tiny_qwen2_5_omni(tmp_path_factory.mktemp("tiny_omni"))
    return transformers.Qwen2_5OmniForConditionalGeneration.from_pretrained(path).eval()


@pytest.fixture(scope="module")
def token2wav(model: Any) -> Qwen2_5OmniToken2Wav:
    return token2wav_from_omni_model(model)


def hf_token2wav(model: Any, codes: list[int], speaker: str, seed: int, **kwargs: Any) -> np.ndarray:
    params = model.speaker_map[speaker]
    torch.manual_seed(seed)
    with torch.no_grad():
        wave = model.token2wav(
            torch.tensor([codes]),
            conditioning=params["cond"].float()[None],
            reference_mel=params["ref_mel"].float(),
            **kwargs,
        )
    return wave.reshape(-1).numpy()


def assert_waveform_close(ours: np.ndarray, ref: np.ndarray) -> None:
    assert ours.dtype == np.float32 and ours.ndim == 1 and ours.shape == ref.shape
    assert np.abs(ref).max() > 0.01  # a real signal, not numerically silent
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("speaker", "seed"), [("Chelsie", 0), ("Ethan", 1234)])
def test_waveform_equals_transformers_token2wav(
    model: Any, token2wav: Qwen2_5OmniToken2Wav, speaker: str, seed: int
) -> None:
    ours = token2wav(CODES, speaker, seed=seed)
    assert ours.shape == (480 * len(CODES),)  # 2 mel frames per code, 240 samples per frame
    assert_waveform_close(ours, hf_token2wav(model, CODES, speaker, seed))


def test_no_guidance_path_equals_transformers(model: Any, token2wav: Qwen2_5OmniToken2Wav) -> None:
    kwargs = {"num_steps": 4, "guidance_scale": 0.0, "sway_coefficient": None}
    ours = token2wav(CODES[:5], "Ethan", seed=3, **kwargs)
    assert_waveform_close(ours, hf_token2wav(model, CODES[:5], "Ethan", 3, **kwargs))


def test_noise_depends_only_on_the_seed(token2wav: Qwen2_5OmniToken2Wav) -> None:
    torch.manual_seed(0)
    first = token2wav(CODES[:4], "Chelsie", seed=5)
    torch.rand(1000)  # other work drawing from the global generator
    np.testing.assert_array_equal(token2wav(CODES[:4], "Chelsie", seed=5), first)
    assert not np.allclose(token2wav(CODES[:4], "Chelsie", seed=6), first)
    torch.manual_seed(5)
    assert torch.equal(token2wav.initial_noise(4), token2wav.initial_noise(4, seed=5))


def test_whole_pipeline_equals_transformers_generate(model: Any) -> None:
    """Thinker text, talker codes and waveform of one greedy ``generate``."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(model.name_or_path)
    input_ids = tokenizer("tell me", return_tensors="pt").input_ids
    torch.manual_seed(42)
    sequences, wave = model.generate(
        input_ids,
        speaker="Ethan",
        thinker_max_new_tokens=6,
        talker_max_new_tokens=20,
        talker_do_sample=False,
        talker_eos_token_id=TALKER_EOS_TOKEN_IDS,
    )
    result = model.thinker.generate(
        input_ids, max_new_tokens=6, output_hidden_states=True, return_dict_in_generate=True
    )
    assert torch.equal(result.sequences, sequences)
    handoff = handoff_from_hf_generate(model, input_ids, result)
    talker = talker_from_omni_model(model, match_transformers_unpadded=True)
    codes = talker_greedy_codes(talker, handoff, SPEAKER_BOS_TOKEN_IDS["Ethan"], 20, repetition_penalty=1.05)
    ours = token2wav_from_omni_model(model)(codes, "Ethan", seed=42)
    assert_waveform_close(ours, wave.numpy())
    assert Qwen2_5OmniToken2Wav.sample_rate == SAMPLE_RATE == 24000


def test_edge_cases(token2wav: Qwen2_5OmniToken2Wav) -> None:
    empty = token2wav([], "Chelsie", seed=0)
    assert empty.dtype == np.float32 and empty.shape == (0,)
    with pytest.raises(ValueError, match="unknown speaker 'Nobody'"):
        token2wav(CODES, "Nobody", seed=0)
    too_long = torch.zeros(token2wav.dit.config.max_position_embeddings // 2 + 1, dtype=torch.long)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        token2wav(too_long, "Chelsie", seed=0)
