"""Qwen2.5-Omni talker stage against transformers, on the tiny whole checkpoint.

The talker gets the hand-off computed from the thinker result of the very same
``generate`` call, so every comparison here is exact (greedy codes equal).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from omnistage.models.qwen2_5_omni_talker import ThinkerOutputForTalker
from omnistage.testing.hf_reference import (
    handoff_from_hf_generate,
    hf_generate_capturing_stages,
    talker_from_omni_model,
    talker_greedy_codes,
)
from omnistage.testing.tiny_omni_checkpoint import (
    SPEAKER_BOS_TOKEN_IDS,
    TALKER_EOS_TOKEN_IDS,
    write_tiny_qwen2_5_omni,
)

transformers = pytest.importorskip("transformers")


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py


@pytest.fixture(scope="module")
def omni_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return write_tiny_qwen2_5_omni(tmp_path_factory.mktemp("tiny_omni"))


@pytest.fixture(scope="module")
def model(omni_dir: Any) -> Any:
    transformers.logging.set_verbosity_error()
    return transformers.Qwen2_5OmniForConditionalGeneration.from_pretrained(omni_dir).eval()


@pytest.fixture(scope="module")
def tokenizer(omni_dir: Any) -> Any:
    return transformers.AutoTokenizer.from_pretrained(omni_dir)


def hf_masked_talker_codes(
    model: Any, talker_kwargs: dict[str, Any], max_new_tokens: int, repetition_penalty: float
) -> list[int]:
    """Greedy codes from HF's talker ``forward`` given a 2-D attention mask:
    the path transformers 4.x's ``generate`` took (and 5.24 takes for padded
    rows), where the prefill gets the codec pad/bos embeddings and M-RoPE."""
    from transformers import DynamicCache
    from transformers.generation.logits_process import (
        RepetitionPenaltyLogitsProcessor,
        SuppressTokensLogitsProcessor,
    )

    talker = model.talker
    talker.rope_deltas = None
    input_ids = talker_kwargs["input_ids"]
    processors = [
        RepetitionPenaltyLogitsProcessor(repetition_penalty),
        SuppressTokensLogitsProcessor([talker.codec_bos_token]),
    ]
    common = {
        "input_text_ids": talker_kwargs["input_text_ids"],
        "image_grid_thw": talker_kwargs.get("image_grid_thw"),
        "cache": DynamicCache(config=talker.config),
        "use_cache": True,
    }
    mask = torch.ones_like(input_ids)
    out = talker(
        input_ids=input_ids,
        inputs_embeds=talker_kwargs["inputs_embeds"].clone(),
        thinker_reply_part=talker_kwargs["thinker_reply_part"],
        attention_mask=mask,
        **common,
    )
    sequence, codes = input_ids, []
    for _ in range(max_new_tokens):
        scores = out.logits[:, -1]
        for processor in processors:
            scores = processor(sequence, scores)
        code = int(scores.argmax(-1))
        if code in TALKER_EOS_TOKEN_IDS:
            break
        codes.append(code)
        sequence = torch.cat([sequence, torch.tensor([[code]])], dim=1)
        mask = torch.ones_like(sequence)
        out = talker(
            input_ids=sequence[:, -1:], thinker_reply_part=out.thinker_reply_part, attention_mask=mask, **common
        )
    return codes


def image_prompt(tokenizer: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A prompt with one image of 2x2 merged tokens (grid 1x4x4 patches)."""
    text = "look <|vision_bos|>" + "<|IMAGE|>" * 4 + "<|vision_eos|> what?"
    input_ids = tokenizer(text, return_tensors="pt").input_ids
    pixels = torch.randn(16, 3 * 14 * 14 * 2, generator=torch.Generator().manual_seed(0))
    return input_ids, {"thinker_pixel_values": pixels, "image_grid_thw": torch.tensor([[1, 4, 4]])}


CASES = [
    # prompt, speaker, repetition penalty, talker max new tokens
    ("what is up", "Chelsie", 1.05, 40),  # generate()'s default penalty; stops at a codec EOS after 5 codes
    ("tell me", "Ethan", 1.05, 32),
    ("a b", "Chelsie", 1.0, 24),
    ("hello world", "Ethan", 1.3, 24),
]


def test_checkpoint_loads_with_speakers_and_matches_thinker_checkpoint(model: Any, tmp_path: Any) -> None:
    from omnistage.testing.tiny_mm_checkpoints import write_tiny_qwen2_5_omni_thinker

    assert set(model.speaker_map) == {"Chelsie", "Ethan"}
    assert model.speaker_map["Chelsie"]["bos_token"] == SPEAKER_BOS_TOKEN_IDS["Chelsie"]
    assert model.config.architectures == ["Qwen2_5OmniForConditionalGeneration"]
    assert model.config.talker_config.embedding_size == model.config.thinker_config.text_config.hidden_size
    assert model.config.talker_config.hidden_size != model.config.talker_config.embedding_size
    thinker_dir = write_tiny_qwen2_5_omni_thinker(tmp_path / "thinker")
    thinker = transformers.Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(thinker_dir)
    for name, tensor in thinker.state_dict().items():
        assert torch.equal(tensor, model.thinker.state_dict()[name]), name


@pytest.mark.parametrize(("prompt", "speaker", "penalty", "max_codes"), CASES)
def test_codes_equal_transformers_generate(
    model: Any, tokenizer: Any, prompt: str, speaker: str, penalty: float, max_codes: int
) -> None:
    input_ids = tokenizer(prompt, return_tensors="pt").input_ids
    hf = hf_generate_capturing_stages(
        model,
        input_ids,
        speaker=speaker,
        thinker_max_new_tokens=6,
        talker_max_new_tokens=max_codes,
        talker_repetition_penalty=penalty,
    )
    # thinker text tokens: the same as a plain thinker generate
    plain = model.thinker.generate(input_ids, max_new_tokens=6)
    assert torch.equal(hf["sequences"], plain)
    handoff = handoff_from_hf_generate(model, input_ids, hf["thinker"])
    assert handoff.thinker_states.shape == (hf["sequences"].shape[1] - 1, 32)
    talker = talker_from_omni_model(model, match_transformers_unpadded=True)
    codes = talker_greedy_codes(talker, handoff, SPEAKER_BOS_TOKEN_IDS[speaker], max_codes, repetition_penalty=penalty)
    assert codes == hf["codes"]
    assert hf["wav"].shape == (480 * len(codes),)


def test_some_case_stops_at_codec_eos(model: Any, tokenizer: Any) -> None:
    prompt, speaker, penalty, max_codes = CASES[0]
    input_ids = tokenizer(prompt, return_tensors="pt").input_ids
    result = model.thinker.generate(
        input_ids, max_new_tokens=6, output_hidden_states=True, return_dict_in_generate=True
    )
    handoff = handoff_from_hf_generate(model, input_ids, result)
    talker = talker_from_omni_model(model, match_transformers_unpadded=True)
    codes = talker_greedy_codes(talker, handoff, SPEAKER_BOS_TOKEN_IDS[speaker], max_codes, repetition_penalty=penalty)
    assert 0 < len(codes) < max_codes


def test_image_prompt_codes_equal_transformers_generate(model: Any, tokenizer: Any) -> None:
    input_ids, mm = image_prompt(tokenizer)
    hf = hf_generate_capturing_stages(
        model, input_ids, speaker="Chelsie", thinker_max_new_tokens=5, talker_max_new_tokens=16, **mm
    )
    handoff = handoff_from_hf_generate(model, input_ids, hf["thinker"], image_grid_thw=mm["image_grid_thw"])
    # image placeholder rows carry the hidden state only (embedding zeroed)
    prompt_states = hf["talker_kwargs"]["inputs_embeds"][0, : input_ids.shape[1]]
    assert torch.equal(handoff.thinker_states[: input_ids.shape[1]], prompt_states)
    talker = talker_from_omni_model(model, match_transformers_unpadded=True)
    assert talker_greedy_codes(talker, handoff, SPEAKER_BOS_TOKEN_IDS["Chelsie"], 16, repetition_penalty=1.05) == hf["codes"]


@pytest.mark.parametrize("use_image", [False, True])
def test_default_codes_equal_transformers_masked_talker(model: Any, tokenizer: Any, use_image: bool) -> None:
    """Default mode = codec pad/bos embeddings in the prefill + M-RoPE."""
    if use_image:
        input_ids, mm = image_prompt(tokenizer)
    else:
        input_ids, mm = tokenizer("tell me", return_tensors="pt").input_ids, {}
    hf = hf_generate_capturing_stages(
        model, input_ids, speaker="Ethan", thinker_max_new_tokens=6, talker_max_new_tokens=2, **mm
    )
    expected = hf_masked_talker_codes(model, hf["talker_kwargs"], 20, repetition_penalty=1.05)
    grids = {"image_grid_thw": mm["image_grid_thw"]} if use_image else {}
    handoff = handoff_from_hf_generate(model, input_ids, hf["thinker"], **grids)
    talker = talker_from_omni_model(model)
    assert talker_greedy_codes(talker, handoff, SPEAKER_BOS_TOKEN_IDS["Ethan"], 20, repetition_penalty=1.05) == expected
    if not use_image:  # and the two modes do differ (from the 6th code on, for this prompt)
        quirk = talker_from_omni_model(model, match_transformers_unpadded=True)
        assert talker_greedy_codes(quirk, handoff, SPEAKER_BOS_TOKEN_IDS["Ethan"], 20, repetition_penalty=1.05) != expected


def test_image_prompt_positions_are_the_thinker_mrope_positions(model: Any, tokenizer: Any) -> None:
    input_ids, mm = image_prompt(tokenizer)
    result = model.thinker.generate(
        input_ids, max_new_tokens=3, output_hidden_states=True, return_dict_in_generate=True,
        pixel_values=mm["thinker_pixel_values"], image_grid_thw=mm["image_grid_thw"],
    )  # fmt: skip
    handoff = handoff_from_hf_generate(model, input_ids, result, image_grid_thw=mm["image_grid_thw"])
    prompt = talker_from_omni_model(model).prepare(handoff, SPEAKER_BOS_TOKEN_IDS["Chelsie"])
    thinker_positions, thinker_delta = model.thinker.get_rope_index(
        input_ids, mm["image_grid_thw"], None, torch.ones_like(input_ids)
    )
    num_prompt = input_ids.shape[1]
    assert torch.equal(prompt.positions[:, :num_prompt], thinker_positions[:, 0])
    assert prompt.rope_delta == int(thinker_delta) < 0  # 4 image tokens on a 2x2 grid compress positions
    tail = torch.arange(num_prompt, num_prompt + 2) + prompt.rope_delta
    assert torch.equal(prompt.positions[:, num_prompt:], tail.expand(3, -1))


@pytest.mark.parametrize("first", ["<|vision_bos|>", "<|audio_bos|>"])
def test_a_media_start_token_generated_first_is_text_for_the_positions(model: Any, tokenizer: Any, first: str) -> None:
    """The first generated token is one of the talker's text ids; when the
    thinker generates a media start token there, transformers' get_rope_index
    looked for an item after it and raised IndexError (seen by the soak in
    tests/engine/test_soak.py), which took the pipeline step down. The
    prompt's items alone place the positions: the token counts as text."""
    input_ids, mm = image_prompt(tokenizer)
    prompt_ids = input_ids[0].tolist()
    states = torch.randn(len(prompt_ids) + 2, 32, generator=torch.Generator().manual_seed(0))
    talker = talker_from_omni_model(model)

    def prepare(first_id: int) -> Any:
        handoff = ThinkerOutputForTalker("r", prompt_ids, [first_id, 5, 6], states, image_grid_thw=mm["image_grid_thw"])
        return talker.prepare(handoff, SPEAKER_BOS_TOKEN_IDS["Chelsie"])

    got, text = prepare(tokenizer.convert_tokens_to_ids(first)), prepare(tokenizer.convert_tokens_to_ids("a"))
    assert torch.equal(got.positions, text.positions) and got.rope_delta == text.rope_delta < 0
    assert torch.equal(got.prefill_embeds, text.prefill_embeds)


def test_handoff_validation() -> None:
    with pytest.raises(ValueError, match="prompt \\+ generated - 1 = 5"):
        ThinkerOutputForTalker("r", [1, 2, 3], [4, 5, 6], torch.zeros(6, 8))
    with pytest.raises(ValueError, match="at least 2 thinker tokens"):
        ThinkerOutputForTalker("r", [1, 2, 3], [4], torch.zeros(3, 8))


def test_unknown_speaker_bos_is_a_clear_error(model: Any) -> None:
    talker = talker_from_omni_model(model)
    handoff = ThinkerOutputForTalker("r", [1, 2], [3, 4], torch.zeros(3, 32))
    with pytest.raises(KeyError, match="no thinker embedding row for token id 7"):
        talker.prepare(handoff, 7)


def test_talker_defaults_match_transformers_generate() -> None:
    """Drift check: omnistage's talker defaults are generate()'s."""
    import inspect

    from omnistage.engine.omni import TalkerParams

    signature = inspect.signature(transformers.Qwen2_5OmniForConditionalGeneration.generate).parameters
    config = transformers.Qwen2_5OmniTalkerConfig()  # the published ids
    ours = TalkerParams.defaults(config)  # (talker_sampling_defaults() before the stage-engine rewrite)
    assert ours.temperature == signature["talker_temperature"].default
    assert ours.top_k == signature["talker_top_k"].default
    assert ours.top_p == signature["talker_top_p"].default
    assert ours.repetition_penalty == signature["talker_repetition_penalty"].default
    assert ours.max_tokens == signature["talker_max_new_tokens"].default
    assert sorted(ours.stop_token_ids) == sorted(signature["talker_eos_token_id"].default)
    assert list(ours.suppress_token_ids) == [config.tts_codec_start_token_id]
    assert signature["speaker"].default == "Chelsie"


def test_resolve_speaker(model: Any) -> None:
    from omnistage.engine.omni import resolve_speaker

    assert resolve_speaker(None, model.speaker_map) == "Chelsie"
    assert resolve_speaker("Ethan", model.speaker_map) == "Ethan"
    assert resolve_speaker(None, {"Zoe": {}, "Adam": {}}) == "Adam"
    with pytest.raises(ValueError, match="unknown speaker 'Nobody'"):
        resolve_speaker("Nobody", model.speaker_map)
    with pytest.raises(ValueError, match="no speakers"):
        resolve_speaker(None, {})
