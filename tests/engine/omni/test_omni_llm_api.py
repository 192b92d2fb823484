"""LLM.generate on an omni checkpoint: what callers get, speakers, seeds, and audio-less requests."""

from __future__ import annotations

import dataclasses
import wave
from typing import Any

import numpy as np
import pytest
import torch
from omni_utils import GREEDY_TALKER, SMALL, assert_nothing_held, assert_same_answer

from omnistage.models.qwen2_5_omni import is_omni_checkpoint
from omnistage import LLM
from omnistage.engine.omni import OmniPipeline
from omnistage.multimodal.media import write_wav
from omnistage.sampling_params import SamplingParams

SP = SamplingParams(temperature=0.0, max_tokens=8)
PROMPT = "hello there, how are you"


@pytest.fixture(scope="module")
def llm(make_llm: Any) -> LLM:
    return make_llm()


@pytest.fixture(scope="module")
def chelsie(llm: LLM) -> Any:
    return llm.generate(PROMPT, SP, speaker="Chelsie")[0]


def test_output_shape_and_types(chelsie: Any) -> None:
    out = chelsie
    assert out.finished and out.outputs[0].finish_reason == "length"
    assert out.outputs[0].text and len(out.outputs[0].token_ids) == 8
    assert isinstance(out.audio, np.ndarray) and out.audio.dtype == np.float32 and out.audio.ndim == 1
    assert out.sample_rate == 24000 and type(out.sample_rate) is int
    assert out.audio.shape == (480 * len(out.extra["codec_token_ids"]),)


def test_speaker_none_is_chelsie_and_ethan_differs(llm: LLM, chelsie: Any) -> None:
    assert_same_answer(llm.generate(PROMPT, SP)[0], chelsie)
    ethan = llm.generate(PROMPT, SP, speaker="Ethan")[0]
    assert ethan.outputs[0].token_ids == chelsie.outputs[0].token_ids  # the text does not depend on the voice
    assert ethan.extra["codec_token_ids"] != chelsie.extra["codec_token_ids"]


def test_return_audio_false_skips_talker_and_token2wav(make_llm: Any, chelsie: Any, monkeypatch: Any) -> None:
    llm = make_llm()
    decoded = []
    # The vocoder is the session's shared token2wav: patched for this test only.
    monkeypatch.setattr(llm.llm_engine.stages["token2wav"].runner.model, "decode_chunk", lambda *a, **k: decoded.append(a))
    out = llm.generate(PROMPT, SP, return_audio=False)[0]
    assert out.audio is None and out.sample_rate is None
    assert out.outputs[0].token_ids == chelsie.outputs[0].token_ids
    assert llm.llm_engine.stages["talker"].scheduler.kv_cache_manager.stats.num_queries == 0 and not decoded
    assert "hidden_states" not in out.multimodal_output  # no rows were kept for a talker
    assert_nothing_held(llm)


def test_bad_requests_raise_and_queue_nothing(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"unknown speaker 'Nobody'.*\['Chelsie', 'Ethan'\]"):
        llm.generate([PROMPT, "second"], SP, speaker="Nobody")
    with pytest.raises(ValueError, match="n=1 only"):
        llm.generate(PROMPT, SamplingParams(n=2, max_tokens=4))
    with pytest.raises(ValueError, match="unknown talker parameters"):
        llm.generate(PROMPT, SP, talker_params={"beam_width": 3})
    assert llm.generate(PROMPT, SamplingParams(n=2, max_tokens=3), return_audio=False)[0].audio is None
    assert_nothing_held(llm)


BAD_TALKER_PARAMS = {
    "top_p": 1.5, "top_k": -5, "max_tokens": 0, "temperature": float("nan"), "repetition_penalty": 0.0,
    "stop_token_ids": "ab", "suppress_token_ids": [-1],
}  # fmt: skip


@pytest.mark.parametrize("field", list(BAD_TALKER_PARAMS))
def test_bad_talker_params_are_refused_before_the_thinker_runs(
    llm: LLM, make_llm: Any, chelsie: Any, field: str
) -> None:
    """Found in review: bad talker_params were accepted, the thinker generated the whole
    answer, and only the hand-off failed it, naming ``SamplingParams.<field>``; an engine
    built with them failed every request that way."""
    bad = {field: BAD_TALKER_PARAMS[field]}
    pipeline = llm.llm_engine
    steps = pipeline.thinker.num_steps
    with pytest.raises(ValueError, match=rf"^talker_params\.{field} must be"):
        pipeline.add_request("bad", PROMPT, SP, talker_params=bad)
    assert not pipeline.has_unfinished_requests() and pipeline.thinker.num_steps == steps
    with pytest.raises(ValueError, match=rf"^talker_params\.{field} must be"):
        make_llm(talker_params={**GREEDY_TALKER, **bad})
    assert_same_answer(llm.generate(PROMPT, SP)[0], chelsie)
    assert_nothing_held(llm)


def test_talker_max_tokens_past_the_talker_context_is_refused(make_llm: Any, chelsie: Any) -> None:
    """Found in review: a request's talker max_tokens above what the talker's context was
    sized for was cut at the hand-off without a word (100 asked, 64 codes, finish "length")."""
    llm = make_llm(talker_max_model_len=None)  # sized for the default: 256 + 2 + max_tokens 8
    pipeline = llm.llm_engine
    assert pipeline.talker_max_tokens == GREEDY_TALKER["max_tokens"]
    with pytest.raises(ValueError, match=r"talker_params\.max_tokens=9 exceeds 8.*talker_max_model_len=266"):
        pipeline.add_request("long", PROMPT, SP, talker_params={"max_tokens": 9})
    assert not pipeline.has_unfinished_requests()
    assert_same_answer(llm.generate(PROMPT, SP, talker_params={"max_tokens": 8})[0], chelsie)
    roomy = make_llm()  # talker_max_model_len=320 leaves 320 - 256 - 2 codes
    assert roomy.llm_engine.talker_max_tokens == 62
    with pytest.raises(ValueError, match=r"talker_params\.max_tokens=63 exceeds 62"):
        roomy.generate(PROMPT, SP, talker_params={"max_tokens": 63})
    # Up to the limit a request gets every code it asked for (no stop codes: it speaks them all).
    out = roomy.generate(PROMPT, SP, talker_params={"max_tokens": 62, "stop_token_ids": []})[0]
    assert out.error is None and len(out.extra["codec_token_ids"]) == 62
    assert_nothing_held(roomy)


def test_seeded_noise_is_transformers_noise_after_manual_seed(make_llm: Any, hf_model: Any) -> None:
    """``SamplingParams.seed`` wins over ``LLM(seed=...)``; either way the
    waveform is transformers' token2wav after ``torch.manual_seed(seed)``."""
    llm = make_llm(seed=5)
    by_engine, by_request = llm.generate([PROMPT, PROMPT], [SP, dataclasses.replace(SP, seed=99)])
    assert by_engine.extra["codec_token_ids"] == by_request.extra["codec_token_ids"]
    assert not np.array_equal(by_engine.audio, by_request.audio)
    for out, seed in ((by_engine, 5), (by_request, 99)):
        params = hf_model.speaker_map["Chelsie"]
        torch.manual_seed(seed)
        with torch.no_grad():
            ref = hf_model.token2wav(
                torch.tensor([out.extra["codec_token_ids"]]),
                conditioning=params["cond"].float()[None],
                reference_mel=params["ref_mel"].float(),
            ).reshape(-1)
        np.testing.assert_allclose(out.audio, ref.numpy(), rtol=1e-5, atol=1e-6)


def test_sampled_talker_audio_depends_only_on_the_request(make_llm: Any) -> None:
    """A sampling talker, seeded per request: the same request gives the same
    audio alone or in a batch. (The tiny codec head's margins are wide, so it
    takes a hot temperature to make sampling differ from greedy.)"""
    prompts = [PROMPT, "tell me a story about the sea", "a b c d"]
    params = [dataclasses.replace(SP, seed=s) for s in (1, 2, 3)]
    sampling = {"max_tokens": 16, "temperature": 8.0, "top_k": 0, "top_p": 1.0}
    batched = make_llm(talker_params=sampling).generate(prompts, params)
    alone = make_llm(talker_params=sampling).generate(prompts[1], params[1])[0]
    assert_same_answer(batched[1], alone)
    greedy = make_llm(talker_params={"temperature": 0.0, "max_tokens": 16}).generate(prompts[1], params[1])[0]
    assert greedy.extra["codec_token_ids"] != alone.extra["codec_token_ids"]


def test_checkpoint_without_audio_output(omni_model: Any) -> None:
    textual = dataclasses.replace(omni_model, talker_module=None, paged_talker=None, token2wav=None)
    llm = LLM(textual, block_size=4, max_model_len=128, num_kv_blocks=64)
    assert llm.llm_engine.stages["thinker"].runner.tensor_cache is not None  # declared by the model; unused but kept
    with pytest.raises(ValueError, match="cannot return audio"):
        llm.generate(PROMPT, SP, return_audio=True)
    out = llm.generate(PROMPT, SP)[0]  # return_audio=None: speak only when the model can
    assert out.audio is None and len(out.outputs[0].token_ids) == 8


def test_chat_and_wav_file(llm: LLM, tmp_path: Any) -> None:
    out = llm.chat([{"role": "user", "content": "hi there"}], SP)[0]
    assert out.prompt and out.audio is not None
    path = write_wav(tmp_path / "answer.wav", out.audio, out.sample_rate)
    with wave.open(str(path)) as f:
        assert (f.getframerate(), f.getnchannels(), f.getsampwidth()) == (24000, 1, 2)
        assert f.getnframes() == out.audio.shape[0]


def test_is_omni_checkpoint(omni_dir: Any, tmp_path: Any) -> None:
    from omnistage.testing.tiny_mm_checkpoints import write_tiny_qwen2_5_omni_thinker

    assert is_omni_checkpoint(omni_dir)
    assert not is_omni_checkpoint(write_tiny_qwen2_5_omni_thinker(tmp_path / "thinker"))
    assert not is_omni_checkpoint(tmp_path / "missing") and not is_omni_checkpoint(None)


def test_short_and_stop_string_answers(llm: LLM, chelsie: Any) -> None:
    one = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=1))[0]
    assert len(one.outputs[0].token_ids) == 1  # nothing for the talker to condition on
    assert one.audio is not None and one.audio.shape == (0,) and one.audio.dtype == np.float32
    assert one.sample_rate == 24000
    # A stop string ends the thinker early; the talker gets exactly the rows it forwarded.
    text = chelsie.outputs[0].text
    stop = next(c for c in text[2:] if c.strip())
    out = llm.generate(PROMPT, dataclasses.replace(SP, stop=[stop]))[0]
    assert out.outputs[0].finish_reason == "stop" and stop not in out.outputs[0].text
    assert len(out.outputs[0].token_ids) < len(chelsie.outputs[0].token_ids)
    assert out.audio is not None
    assert_nothing_held(llm)


def test_llm_dispatches_omni_checkpoints_to_the_pipeline(omni_dir: Any, chelsie: Any) -> None:
    llm = LLM(model=str(omni_dir), **SMALL, talker_params=dict(GREEDY_TALKER))
    assert isinstance(llm.llm_engine, OmniPipeline)
    out = llm.generate(PROMPT, SP)[0]
    assert_same_answer(out, chelsie)
    assert np.array_equal(out.audio, chelsie.audio) and out.sample_rate == 24000


def test_cli_generate_writes_the_spoken_answer(omni_dir: Any, tmp_path: Any, chelsie: Any) -> None:
    import io
    import json

    from omnistage.entrypoints.cli import build_parser, run_generate

    args = build_parser().parse_args(
        ["generate", PROMPT, "--model", str(omni_dir), "--max-tokens", "8", "--audio-dir", str(tmp_path),
         "--block-size", "4", "--max-model-len", "256", "--num-kv-blocks", "256", "--talker-max-tokens", "8"]
    )
    out = io.StringIO()
    assert run_generate(args, out) == 0
    row = json.loads(out.getvalue())
    assert row["token_ids"] == chelsie.outputs[0].token_ids
    assert row["sample_rate"] == 24000
    with wave.open(row["audio_path"], "rb") as f:
        assert f.getframerate() == 24000 and f.getnchannels() == 1 and f.getnframes() > 0


def test_prompt_logprobs_come_with_the_spoken_answer(llm: LLM, chelsie: Any, hf_model: Any) -> None:
    """The thinker's prompt logprobs reach the caller (transformers' thinker log-softmax) and the
    answer, speech included, is the one without them."""
    out = llm.generate(PROMPT, dataclasses.replace(SP, prompt_logprobs=1))[0]
    assert_same_answer(out, chelsie)
    ids = out.prompt_token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf_model.thinker(input_ids=torch.tensor([ids])).logits[0].float(), -1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    got = [out.prompt_logprobs[j][ids[j]] for j in range(1, len(ids))]
    assert got == pytest.approx([ref[j - 1, ids[j]].item() for j in range(1, len(ids))], abs=1e-4)
    assert_nothing_held(llm)


def test_a_truncated_prompt_speaks_as_its_kept_tokens_do(llm: LLM, chelsie: Any) -> None:
    """``truncate_prompt_tokens`` cuts the thinker's prompt: text, codec tokens and speech are those
    of sending the kept tokens alone."""
    ids = chelsie.prompt_token_ids
    longer = {"prompt_token_ids": [5, 6, 7] + ids}
    cut = llm.generate(longer, dataclasses.replace(SP, truncate_prompt_tokens=len(ids)), speaker="Chelsie")[0]
    assert cut.prompt_token_ids == ids and len(cut.audio) > 0
    assert_same_answer(cut, chelsie)
    assert_nothing_held(llm)
