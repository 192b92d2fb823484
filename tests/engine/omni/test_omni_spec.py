"""Speculation on the Qwen2.5-Omni thinker: the talker and token2wav never see a rejected draft.

The thinker speculates (n-gram prompt lookup, or an EAGLE head); only the
verified tokens' per-token rows are returned for the talker and written to
the tensor prefix cache. Text, codec tokens and waveform equal speculation
off, first turns and second turns that hit the prefix cache alike, with an
audio prompt too; nothing is held afterwards. The talker never speculates.
"""

from __future__ import annotations

from typing import Any

import pytest
from omni_utils import assert_nothing_held, assert_same_answer

from omnistage.sampling_params import SamplingParams
from omnistage.testing.tiny_eagle import write_tiny_eagle_head

SP = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SYSTEM = "system: you are a helpful voice assistant. user: one two three four one two three four one two three"
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_max": 2,
    "prompt_lookup_min": 1,
}


@pytest.fixture(scope="module")
def eagle(omni_dir: Any, tmp_path_factory: pytest.TempPathFactory) -> dict:
    head = write_tiny_eagle_head(omni_dir, tmp_path_factory.mktemp("omni_eagle_head"))
    return {"method": "eagle", "model": str(head), "num_speculative_tokens": 3}


def conversation(llm: Any) -> list[Any]:
    """A first turn, then a second turn that hits it and an audio prompt, together."""
    import numpy as np

    tok = llm.get_tokenizer()
    base = tok(SYSTEM).input_ids
    first = llm.generate([base], SP)[0]
    turn2 = (
        base + list(first.outputs[0].token_ids) + tok(" user: and then what?").input_ids
    )
    audio = (
        (np.random.default_rng(0).standard_normal(16000) * 0.1).astype(np.float32),
        16000,
    )
    spoken = {
        "prompt": "<|audio_bos|><|AUDIO|><|audio_eos|> what is this?",
        "multi_modal_data": {"audio": audio},
    }
    return [first, *llm.generate([turn2, spoken], SP)]


@pytest.fixture(scope="module")
def spec_off(make_llm: Any) -> list[Any]:
    return conversation(make_llm())


@pytest.mark.parametrize("method", ["ngram", "eagle"])
def test_text_codes_and_waveform_equal_speculation_off(
    method: str, make_llm: Any, spec_off: list, eagle: dict, always_draft: None
) -> None:
    llm = make_llm(speculative_config=NGRAM if method == "ngram" else eagle)
    thinker = llm.llm_engine.stages["thinker"]
    assert llm.llm_engine.stages["talker"].scheduler.config.speculative_config is None
    written: dict[str, int] = {}  # rows written to the tensor prefix cache per request
    cache = thinker.runner.tensor_cache
    original = cache.write

    def spy(step: Any, states: Any) -> None:
        assert states.shape[0] == step.num_tokens
        for rid, n in zip(step.req_ids, step.num_scheduled_tokens.tolist()):
            written[rid] = written.get(rid, 0) + n
        original(step, states)

    cache.write = spy  # type: ignore[method-assign]
    outs = conversation(llm)
    for ours, ref in zip(outs, spec_off):
        assert ours.audio is not None
        assert_same_answer(ours, ref)
    assert outs[1].num_cached_tokens == spec_off[1].num_cached_tokens > 0
    stats = thinker.get_stats()
    assert stats.num_draft_tokens > 0
    if (
        method == "ngram"
    ):  # the first answer repeats a token: a draft is accepted (rows of the accept path)
        assert stats.num_accepted_tokens > 0
    # Only verified tokens were written: exactly the forwarded tokens of each sequence
    # (the first turn had no hit; the second turn's hit prefix was not forwarded).
    first = outs[0]
    assert (
        written[first.request_id]
        == len(first.prompt_token_ids) + len(first.outputs[0].token_ids) - 1
    )
    second = outs[1]
    forwarded = (
        len(second.prompt_token_ids)
        + len(second.outputs[0].token_ids)
        - 1
        - second.num_cached_tokens
    )
    assert written[second.request_id] == forwarded
    assert_nothing_held(llm)
