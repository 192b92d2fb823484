"""Thinker prefix-cache hits never change what the talker and token2wav get.

A second turn that repeats the first turn's prompt and answer hits the
thinker's KV prefix cache. The talker still needs the per-token rows of that
prefix: the tensor prefix cache supplies them, and text, codes and waveform
equal those of the same requests with prefix caching off.
"""

from __future__ import annotations

from typing import Any

import pytest
from omni_utils import assert_nothing_held, assert_same_answer, run_until_idle

from omnistage.sampling_params import SamplingParams

SP = SamplingParams(temperature=0.0, max_tokens=6)
SYSTEM = "system: you are a helpful voice assistant. user: tell me a story about a fox and a dog, please."


def conversation(llm: Any) -> list[Any]:
    """Turn 1, then three requests added together: two second turns (hits of
    different lengths) and an unrelated prompt (a miss)."""
    tok = llm.get_tokenizer()
    base = tok(SYSTEM).input_ids
    first = llm.generate([base], SP)[0]
    turn2 = base + list(first.outputs[0].token_ids) + tok(" user: and then what?").input_ids
    again = base + tok(" and a cat").input_ids
    other = tok("an unrelated prompt that shares nothing with the others").input_ids
    return [first, *llm.generate([turn2, other, again], SP)]


@pytest.fixture(scope="module")
def cache_off(make_llm: Any) -> dict[int | None, list[Any]]:
    """Reference answers with prefix caching off, per prefill chunk budget."""
    return {chunk: conversation(make_llm(enable_prefix_caching=False, **_chunk(chunk))) for chunk in (None, 8)}


def _chunk(chunk: int | None) -> dict[str, int]:
    return {} if chunk is None else {"max_num_batched_tokens": chunk}


@pytest.mark.parametrize("chunk", [None, 8], ids=["whole-prefill", "chunked-prefill"])
def test_second_turn_hits_and_equals_cache_off(make_llm: Any, cache_off: dict, chunk: int | None) -> None:
    llm = make_llm(**_chunk(chunk))
    outs = conversation(llm)
    cache = llm.llm_engine.stages["thinker"].runner.tensor_cache
    assert [o.num_cached_tokens > 0 for o in outs] == [False, True, False, True]
    assert cache.num_hit_requests == 2 and cache.num_hit_rows == outs[1].num_cached_tokens + outs[3].num_cached_tokens
    for ours, ref in zip(outs, cache_off[chunk]):
        assert ours.audio is not None
        assert_same_answer(ours, ref)
    assert len(outs[1].extra["codec_token_ids"]) > 0
    assert_nothing_held(llm)


def test_hits_and_misses_share_one_step(make_llm: Any, cache_off: dict) -> None:
    """With the default budget the three requests of the second call are all
    admitted in the same thinker step (two hits, one miss) and merged there."""
    llm = make_llm()
    cache = llm.llm_engine.stages["thinker"].runner.tensor_cache
    steps: list[tuple[int, int]] = []  # (requests in the step, hits merged in it)
    original = cache.merge

    def spy(step: Any, *args: Any) -> Any:
        before = cache.num_hit_requests
        merged = original(step, *args)
        steps.append((len(step.req_ids), cache.num_hit_requests - before))
        return merged

    cache.merge = spy  # type: ignore[method-assign]
    outs = conversation(llm)
    assert (3, 2) in steps
    for ours, ref in zip(outs, cache_off[None]):
        assert_same_answer(ours, ref)


def test_preempted_request_rebuilds_its_rows(make_llm: Any) -> None:
    """A KV pool too small for three requests at once preempts the latest; on
    resume it is a new request (a hit on its own blocks) and the merge
    rebuilds its rows. Results equal those of a pool large enough."""
    tok_prompts = [SYSTEM, SYSTEM + " once more", "short prompt here", "another short one"]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    roomy = make_llm().generate(tok_prompts, params)
    tight = make_llm(num_kv_blocks=40)
    outs = tight.generate(tok_prompts, params)
    assert tight.llm_engine.stages["thinker"].scheduler.num_preemptions > 0
    for ours, ref in zip(outs, roomy):
        assert_same_answer(ours, ref)
    assert_nothing_held(tight)


def test_tensor_cache_off_with_a_hit_raises_instead_of_truncating(make_llm: Any) -> None:
    llm = make_llm(enable_tensor_prefix_cache=False)
    assert llm.llm_engine.stages["thinker"].runner.tensor_cache is None
    with pytest.raises(RuntimeError, match="per-token rows for the talker, expected"):
        conversation(llm)
    run_until_idle(llm)
    assert_nothing_held(llm)


def test_text_only_requests_still_fill_the_cache_for_later_audio(make_llm: Any, cache_off: dict) -> None:
    """Blocks of a request that asked for no audio are hit by one that does."""
    llm = make_llm()
    base = llm.get_tokenizer()(SYSTEM).input_ids
    first = llm.generate([base], SP, return_audio=False)[0]
    assert first.audio is None
    second = llm.generate([base + llm.get_tokenizer()(" and a cat").input_ids], SP)[0]
    assert second.num_cached_tokens > 0
    assert_same_answer(second, cache_off[None][3])


def test_cache_exists_only_with_prefix_caching_and_is_sized_from_the_kv_pool(make_llm: Any) -> None:
    off = make_llm(enable_prefix_caching=False)
    assert off.llm_engine.stages["thinker"].runner.tensor_cache is None
    on = make_llm(num_kv_blocks=100)
    cache = on.llm_engine.stages["thinker"].runner.tensor_cache
    hidden = on.llm_engine.stages["thinker"].loaded_model.model.hidden_size
    slots = 100 * 4
    assert cache.cache.hidden_states_cache.shape == (100, 4, hidden)
    assert cache.nbytes == slots * hidden * 4 + slots  # fp32 rows + one validity flag per slot
    # The talker declares nothing: its stage has no tensor cache at all.
    assert on.llm_engine.stages["talker"].runner.tensor_cache is None
