"""Aborting a request in any stage frees everything it held there, and leaves
the other requests' answers untouched."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from omni_utils import assert_nothing_held, assert_same_answer, run_until_idle

from omnistage.sampling_params import SamplingParams

SP = SamplingParams(temperature=0.0, max_tokens=8)
PROMPTS = {
    "victim": "system: you are a helpful voice assistant. user: tell me a story about a fox and a dog",
    "bystander": "hello there, how are you",
}


def _in_thinker_waiting(llm: Any) -> bool:
    return True  # abort right after add: the request has not been scheduled yet


def _in_thinker_running(llm: Any) -> bool:
    return llm.llm_engine.stages["thinker"].held().batch_rows > 0


def _in_talker(llm: Any) -> bool:
    talker = llm.llm_engine.stages["talker"]
    return talker.held().batch_rows > 0 and "victim" in talker.output_processor.states


def _in_token2wav(llm: Any) -> bool:
    return llm.llm_engine.stages["token2wav"].held().requests > 0


WHERE: dict[str, Callable[[Any], bool]] = {
    "thinker-waiting": _in_thinker_waiting,
    "thinker-running": _in_thinker_running,
    "talker": _in_talker,
    "token2wav": _in_token2wav,
}


@pytest.fixture(scope="module")
def bystander_alone(make_llm: Any) -> Any:
    out = make_llm().generate([PROMPTS["bystander"]], SP)[0]
    assert out.extra["codec_token_ids"]  # it really goes through every stage
    return out


@pytest.mark.parametrize("where", list(WHERE))
def test_abort_in_any_stage_frees_everything(make_llm: Any, bystander_alone: Any, where: str) -> None:
    # The bystander arrives later so that the victim reaches each stage first.
    llm = make_llm()
    pipeline = llm.llm_engine
    token2wav_step = pipeline.stages["token2wav"].step
    if where == "token2wav":  # hold the queue: token2wav would otherwise take it in the same step
        pipeline.stages["token2wav"].step = list  # type: ignore[method-assign]
    pipeline.add_request("victim", PROMPTS["victim"], SP)
    done = []
    for _ in range(200):
        if WHERE[where](llm):
            break
        done.extend(o for o in pipeline.step() if o.finished)
    else:
        pytest.fail(f"the request never reached {where}")
    pipeline.stages["token2wav"].step = token2wav_step  # type: ignore[method-assign]
    pipeline.add_request("bystander", PROMPTS["bystander"], SP)
    pipeline.abort_request("victim")
    # KV blocks are back in the pool at once; batch rows go at the stages' next step.
    held = pipeline.held()
    assert held["thinker"].kv_blocks == held["talker"].kv_blocks == held["token2wav"].requests == 0
    assert held["pipeline"].requests == 1  # the bystander
    done.extend(run_until_idle(llm))
    assert [o.request_id for o in done] == ["bystander"]
    assert_same_answer(done[0], bystander_alone)
    assert_nothing_held(llm)


def test_abort_everything_mid_flight_then_serve_again(make_llm: Any, bystander_alone: Any) -> None:
    llm = make_llm()
    pipeline = llm.llm_engine
    for i in range(4):
        pipeline.add_request(f"r{i}", PROMPTS["victim"] + f" number {i}", SP)
    for _ in range(12):
        pipeline.step()
    pipeline.abort_request([f"r{i}" for i in range(4)] + ["unknown"])
    assert not pipeline.step()  # nothing comes out of aborted requests
    run_until_idle(llm)
    assert_nothing_held(llm)
    # The freed blocks and rows are reused correctly by the next request.
    again = llm.generate([PROMPTS["bystander"]], SP)[0]
    assert_same_answer(again, bystander_alone)
    assert_nothing_held(llm)


def test_exception_inside_generate_aborts_its_requests(make_llm: Any) -> None:
    llm = make_llm()
    original = llm.llm_engine.stages["talker"].step
    calls = {"n": 0}

    def failing_step() -> Any:
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return original()

    llm.llm_engine.stages["talker"].step = failing_step  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        llm.generate([PROMPTS["victim"], PROMPTS["bystander"]], SP)
    llm.llm_engine.stages["talker"].step = original  # type: ignore[method-assign]
    run_until_idle(llm)
    assert_nothing_held(llm)
    out = llm.generate([PROMPTS["bystander"]], SP)[0]
    assert out.audio is not None and out.audio.dtype == np.float32


def test_request_id_reused_right_after_an_abort(make_llm: Any, bystander_alone: Any) -> None:
    """Issue 13, defect 2: an aborted id added again at once (before any stage stepped
    past the abort) runs as a new request. The old thinker runner dropped the id's
    per-token registration one step late and so wiped the new request's."""
    llm = make_llm()
    pipeline = llm.llm_engine
    pipeline.add_request("x", PROMPTS["victim"], SP, return_audio=True)
    pipeline.step()
    pipeline.step()
    pipeline.abort_request("x")
    pipeline.add_request("x", PROMPTS["bystander"], SP, return_audio=True)
    done = run_until_idle(llm)
    assert [o.request_id for o in done] == ["x"]
    assert_same_answer(done[0], bystander_alone)
    assert_nothing_held(llm)
