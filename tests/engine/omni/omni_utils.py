"""Helpers for the omni pipeline tests (fixtures live in conftest.py)."""

from __future__ import annotations

from typing import Any

import numpy as np

from omnistage import LLM

# Small pools and lengths keep every engine cheap to build. Block size 4 makes
# short prompts span several full blocks, so prefix hits are real.
SMALL = {"block_size": 4, "max_model_len": 256, "num_kv_blocks": 256, "talker_max_model_len": 320, "max_num_seqs": 8}
GREEDY_TALKER = {"temperature": 0.0, "max_tokens": 8}


def run_until_idle(llm: LLM, max_steps: int = 10_000) -> list[Any]:
    """Step the pipeline until nothing is left; the outputs that completed."""
    outs = []
    for _ in range(max_steps):
        if not llm.llm_engine.has_unfinished_requests():
            return outs
        outs.extend(o for o in llm.llm_engine.step() if o.finished)
    raise AssertionError("the pipeline did not go idle")


def assert_same_answer(a: Any, b: Any) -> None:
    """Same thinker tokens, same codec tokens, same waveform (bit for bit)."""
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert a.outputs[0].text == b.outputs[0].text
    assert a.extra.get("codec_token_ids") == b.extra.get("codec_token_ids")
    if a.audio is None or b.audio is None:
        assert a.audio is None and b.audio is None
    else:
        assert a.audio.dtype == np.float32 and np.array_equal(a.audio, b.audio)


def assert_nothing_held(llm: LLM) -> None:
    held = llm.llm_engine.held()
    assert all(h.is_empty for h in held.values()), {k: v for k, v in held.items() if not v.is_empty}
