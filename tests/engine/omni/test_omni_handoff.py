"""Hand-offs between the stages: whatever the thinker generates is handed on,
and a hand-off that fails anyway fails its own request, not the pipeline step."""

from __future__ import annotations

from typing import Any

import numpy as np
from omni_utils import assert_nothing_held, assert_same_answer, run_until_idle
from PIL import Image

from omnistage.sampling_params import SamplingParams

SP = SamplingParams(temperature=0.0, max_tokens=6)
BYSTANDER = "hello there, how are you"


def _image_prompt() -> dict[str, Any]:
    pixels = np.random.default_rng(0).integers(0, 256, (56, 56, 3), dtype=np.uint8)
    return {"prompt": "<|vision_bos|><|IMAGE|><|vision_eos|>what is this?",
            "multi_modal_data": {"image": Image.fromarray(pixels)}}  # fmt: skip


def test_a_media_start_token_generated_first_still_speaks(make_llm: Any) -> None:
    """Found by tests/engine/test_soak.py: a thinker answer to an image prompt
    that starts with <|vision_bos|> made the talker's position computation
    raise IndexError out of the pipeline step."""
    llm = make_llm()
    start = llm.get_tokenizer().convert_tokens_to_ids("<|vision_bos|>")
    params = SamplingParams(temperature=0.0, max_tokens=4, allowed_token_ids=[start])
    (out,) = llm.generate([_image_prompt()], params)
    assert out.outputs[0].token_ids == [start] * 4
    assert out.error is None and out.audio is not None and out.audio.size > 0
    assert_nothing_held(llm)


def test_a_failed_hand_off_fails_its_request_alone(make_llm: Any) -> None:
    llm = make_llm()
    alone = llm.generate([BYSTANDER], SP)[0]
    pipeline = llm.llm_engine
    talker_inputs = pipeline.stages["talker"].input_processor
    process = talker_inputs.process

    def failing(request_id: str, request: Any) -> Any:
        if request_id == "victim":
            raise RuntimeError("no talker prompt for you")
        return process(request_id, request)

    talker_inputs.process = failing
    try:
        pipeline.add_request("victim", BYSTANDER + " today", SP)
        pipeline.add_request("bystander", BYSTANDER, SP)
        done = {o.request_id: o for o in run_until_idle(llm)}
    finally:
        talker_inputs.process = process
    assert set(done) == {"victim", "bystander"}
    error = done["victim"].error
    assert error is not None and "'victim'" in error and "no talker prompt for you" in error
    assert done["bystander"].error is None
    assert_same_answer(done["bystander"], alone)
    assert_nothing_held(llm)
