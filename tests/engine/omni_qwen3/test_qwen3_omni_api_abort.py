"""LLM on a Qwen3-Omni folder: what callers get, voices, audio-less requests, and
aborts at every stage that free everything and leave other answers untouched."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from qwen3_utils import (
    assert_nothing_held,
    assert_same_answer,
    chat_ids,
    run_until_idle,
)

from omnistage import LLM
from omnistage.engine.omni import OmniPipeline
from omnistage.models.qwen2_5_omni import is_omni_checkpoint
from omnistage.models.qwen3_omni import is_qwen3_omni_checkpoint
from omnistage.sampling_params import SamplingParams

SP = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def llm(make_q3: Any) -> LLM:
    return make_q3()


@pytest.fixture(scope="module")
def prompts(llm: LLM) -> dict[str, dict[str, list[int]]]:
    tok = llm.get_tokenizer()
    return {
        "victim": {
            "prompt_token_ids": chat_ids(tok, "tell me a story about a fox and a dog")
        },
        "bystander": {"prompt_token_ids": chat_ids(tok, "hello there, how are you")},
    }


@pytest.fixture(scope="module")
def bystander_alone(llm: LLM, prompts: dict) -> Any:
    out = llm.generate([prompts["bystander"]], SP, use_tqdm=False)[0]
    assert out.extra["codec_frames"]  # it really goes through every stage
    return out


def test_llm_from_the_folder(q3_dir: Any, bystander_alone: Any, prompts: dict) -> None:
    assert is_qwen3_omni_checkpoint(q3_dir) and is_omni_checkpoint(q3_dir)
    llm = LLM(
        model=str(q3_dir),
        talker_params={"temperature": 0, "repetition_penalty": 1.0, "max_tokens": 10},
    )
    assert isinstance(llm.llm_engine, OmniPipeline)
    assert llm.output_modalities == frozenset({"text", "audio"})
    assert llm.llm_engine.voices == ("Chelsie", "Ethan")
    out = llm.generate([prompts["bystander"]], SP, use_tqdm=False)[0]
    assert (
        isinstance(out.audio, np.ndarray)
        and out.audio.dtype == np.float32
        and out.audio.ndim == 1
    )
    assert out.sample_rate == 24000 and type(out.sample_rate) is int
    assert out.audio.shape == (1920 * len(out.extra["codec_frames"]) - 555,)
    assert_same_answer(out, bystander_alone)


def test_voices_and_audio_less_requests(
    llm: LLM, bystander_alone: Any, prompts: dict
) -> None:
    p = prompts["bystander"]
    assert_same_answer(
        llm.generate([p], SP, speaker="ETHAN", use_tqdm=False)[0], bystander_alone
    )
    chelsie = llm.generate([p], SP, speaker="Chelsie", use_tqdm=False)[0]
    assert chelsie.outputs[0].token_ids == bystander_alone.outputs[0].token_ids
    assert chelsie.extra["codec_frames"] != bystander_alone.extra["codec_frames"]
    text_only = llm.generate([p], SP, return_audio=False, use_tqdm=False)[0]
    assert text_only.audio is None and text_only.sample_rate is None
    assert text_only.outputs[0].token_ids == bystander_alone.outputs[0].token_ids
    with pytest.raises(
        ValueError, match=r"unknown speaker 'Nobody'.*\['Chelsie', 'Ethan'\]"
    ):
        llm.generate([p], SP, speaker="Nobody")
    with pytest.raises(ValueError, match="unknown talker parameters"):
        llm.generate([p], SP, talker_params={"beam_width": 3})
    assert_nothing_held(llm)


def test_a_prompt_without_an_assistant_turn_fails_alone(
    llm: LLM, bystander_alone: Any, prompts: dict
) -> None:
    llm.llm_engine.add_request("bad", "no chat template here", SP)
    llm.llm_engine.add_request("good", prompts["bystander"], SP)
    outs = {o.request_id: o for o in run_until_idle(llm)}
    assert "no assistant turn" in (outs["bad"].error or "")
    assert outs["good"].error is None
    assert_same_answer(outs["good"], bystander_alone)
    assert_nothing_held(llm)


def test_suppress_token_ids_extend_the_defaults(
    llm: LLM, bystander_alone: Any, prompts: dict
) -> None:
    """Found in review: a request's talker ``suppress_token_ids`` replaced the defaults,
    which keep the talker off the control ids past the codebook; it then made codes that
    code2wav cannot embed, and the IndexError failed the vocoder's whole batch."""
    pipeline = llm.llm_engine
    bos = int(pipeline.stages["talker"].loaded_model.hf_config.codec_bos_id)  # suppressed already
    pipeline.add_request("extra", prompts["bystander"], SP, talker_params={"suppress_token_ids": [bos]})
    pipeline.add_request("bystander", prompts["bystander"], SP)
    outs = {o.request_id: o for o in run_until_idle(llm)}
    for out in outs.values():
        assert out.error is None
        assert_same_answer(out, bystander_alone)
    assert_nothing_held(llm)


def test_codes_past_the_codebook_fail_their_request_alone(
    llm: LLM, bystander_alone: Any, prompts: dict
) -> None:
    """Should a talker make codes past code2wav's codebook anyway, only that request
    fails, naming the talker parameter, and not the vocoder batch it would share."""
    pipeline = llm.llm_engine
    defaults = pipeline.default_talker_params
    # No request can drop the default suppressions: a talker without them stands in.
    pipeline.default_talker_params = dataclasses.replace(defaults, suppress_token_ids=())
    try:
        pipeline.add_request("victim", prompts["bystander"], SP)
    finally:
        pipeline.default_talker_params = defaults
    pipeline.add_request("bystander", prompts["bystander"], SP)
    outs = {o.request_id: o for o in run_until_idle(llm)}
    error = outs["victim"].error or ""
    assert "'victim'" in error and "codebook" in error and "talker_params.suppress_token_ids" in error
    assert outs["bystander"].error is None
    assert_same_answer(outs["bystander"], bystander_alone)
    assert_nothing_held(llm)


def _in_thinker_waiting(llm: Any) -> bool:
    return True


def _in_thinker_running(llm: Any) -> bool:
    return llm.llm_engine.stages["thinker"].held().batch_rows > 0


def _in_talker(llm: Any) -> bool:
    talker = llm.llm_engine.stages["talker"]
    return talker.held().batch_rows > 0 and talker.held().staged_tensors > 0


def _in_code2wav(llm: Any) -> bool:
    return llm.llm_engine.stages["token2wav"].held().requests > 0


WHERE: dict[str, Callable[[Any], bool]] = {
    "thinker-waiting": _in_thinker_waiting,
    "thinker-running": _in_thinker_running,
    "talker-with-staged-frames": _in_talker,
    "code2wav": _in_code2wav,
}


@pytest.mark.parametrize("where", list(WHERE))
def test_abort_in_any_stage_frees_everything(
    make_q3: Any, prompts: dict, bystander_alone: Any, where: str
) -> None:
    llm = make_q3()
    pipeline = llm.llm_engine
    vocoder_step = pipeline.stages["token2wav"].step
    if (
        where == "code2wav"
    ):  # hold its queue: it would otherwise decode in the same step
        pipeline.stages["token2wav"].step = list  # type: ignore[method-assign]
    pipeline.add_request("victim", prompts["victim"], SP)
    done = []
    for _ in range(200):
        if WHERE[where](llm):
            break
        done.extend(o for o in pipeline.step() if o.finished)
    else:
        pytest.fail(f"the request never reached {where}")
    pipeline.stages["token2wav"].step = vocoder_step  # type: ignore[method-assign]
    pipeline.add_request("bystander", prompts["bystander"], SP)
    pipeline.abort_request("victim")
    held = pipeline.held()
    assert (
        held["thinker"].kv_blocks
        == held["talker"].kv_blocks
        == held["token2wav"].requests
        == 0
    )
    if (
        where != "code2wav"
    ):  # a talker that finished commits its frames at its next step instead
        assert held["talker"].staged_tensors == 0  # staged frames discarded at once
    done.extend(run_until_idle(llm))
    assert [o.request_id for o in done] == ["bystander"]
    assert_same_answer(done[0], bystander_alone)
    assert_nothing_held(llm)


def test_encoder_workers_are_refused_until_they_load_qwen3_towers(make_q3: Callable[..., LLM]) -> None:
    """A worker runs the towers alone, which Qwen3-Omni's (deepstack rows) cannot do yet: the
    engine refuses the option at build instead of respawning workers that never start."""
    with pytest.raises(ValueError, match=r"num_encoder_workers=1: .*not supported for model type 'qwen3_omni"):
        make_q3(num_encoder_workers=1)
