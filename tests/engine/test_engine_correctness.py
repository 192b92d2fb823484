"""Greedy outputs equal transformers' generate, whatever the batching, chunking,
prefix caching or preemption; the KV pool is clean afterwards."""

from __future__ import annotations

import dataclasses

import pytest
from utils_engine import GREEDY, PROMPTS, assert_pool_clean, make_engine, run_all

from omnistage.sampling_params import SamplingParams


def _ids(loaded, prompts):
    return [loaded.tokenizer.encode(p) for p in prompts]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_matches_hf_batch_one_and_many(arch, tiny_loaded, hf_reference):
    loaded = tiny_loaded(arch)
    engine = make_engine(loaded)
    refs = [hf_reference(arch, ids, GREEDY.max_tokens) for ids in _ids(loaded, PROMPTS)]
    # Batch of one, one request after the other.
    for i, prompt in enumerate(PROMPTS):
        (out,) = run_all(engine, [prompt], GREEDY, prefix=f"solo{i}-")
        assert out.outputs[0].token_ids == refs[i]
        assert out.outputs[0].finish_reason == "length"
    # All prompts (different lengths) in one batch, repeated so the batch holds
    # eight rows and the second copies hit the prefix cache of the first.
    outs = run_all(engine, PROMPTS + PROMPTS, GREEDY, prefix="many-")
    assert [o.outputs[0].token_ids for o in outs] == refs + refs
    assert_pool_clean(engine)


SHARED = "the quick brown fox jumps over the lazy dog. hello world! a small model reads a short prompt "
CACHE_PROMPTS = [SHARED + "and writes", SHARED + "one two three four", "what is the capital of france?", SHARED]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("budget", [1, 7, 64])
@pytest.mark.parametrize("caching", [True, False])
def test_chunking_and_prefix_cache_do_not_change_outputs(arch, budget, caching, tiny_loaded, hf_reference):
    loaded = tiny_loaded(arch)
    engine = make_engine(loaded, max_num_batched_tokens=budget, enable_prefix_caching=caching, block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    refs = [hf_reference(arch, ids, 6) for ids in _ids(loaded, CACHE_PROMPTS)]
    first = run_all(engine, CACHE_PROMPTS, params, prefix="a")
    second = run_all(engine, CACHE_PROMPTS, params, prefix="b")  # the same prompts again: cache hits
    assert [o.outputs[0].token_ids for o in first] == refs
    assert [o.outputs[0].token_ids for o in second] == refs
    stats = engine.get_stats()
    if caching:
        assert stats.prefix_cache_hit_tokens > 0
        assert all(o.num_cached_tokens > 0 for o in second)
        assert all(o.metrics.num_cached_tokens == o.num_cached_tokens for o in second)
    else:
        assert stats.prefix_cache_hit_tokens == 0
        assert all(o.num_cached_tokens == 0 for o in first + second)
    assert_pool_clean(engine)


@pytest.mark.parametrize("caching", [True, False])
def test_preemption_keeps_outputs_and_frees_everything(caching, tiny_loaded, hf_reference):
    loaded = tiny_loaded("llama")
    # 6 requests that end near 30 tokens need ~8 blocks of 4 each; 20 blocks hold ~2.5 of them.
    engine = make_engine(loaded, block_size=4, num_kv_blocks=20, enable_prefix_caching=caching)
    prompts = PROMPTS[:3] + ["images, audio and video go in", "one two three four five", "paris"]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    refs = [hf_reference("llama", ids, 16) for ids in _ids(loaded, prompts)]
    outs = run_all(engine, prompts, params)
    assert engine.get_stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert_pool_clean(engine)


def test_seeded_sampling_survives_preemption(tiny_loaded):
    """A preempted seeded request resumes its random stream: same tokens as
    a run with room for everyone."""
    loaded = tiny_loaded("llama")
    prompts = PROMPTS[:3] + ["images, audio and video go in", "one two three four five", "paris"]
    params = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=16, ignore_eos=True) for i in range(6)]
    roomy = run_all(make_engine(loaded, block_size=4), prompts, params)
    tight_engine = make_engine(loaded, block_size=4, num_kv_blocks=20)
    tight = run_all(tight_engine, prompts, params)
    assert tight_engine.get_stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in tight] == [o.outputs[0].token_ids for o in roomy]


def test_abort_frees_blocks_and_others_finish(tiny_loaded, hf_reference):
    loaded = tiny_loaded("qwen2")
    engine = make_engine(loaded, max_num_seqs=2, block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, params)
    outs = {}
    for _ in range(3):  # r0, r1 running; r2, r3 waiting (max_num_seqs=2)
        for o in engine.step():
            outs[o.request_id] = o
    engine.abort_request(["r1", "r3", "unknown-id"])
    assert engine.get_num_unfinished_requests() == 2
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
            assert o.request_id not in ("r1", "r3") or not o.finished
    for i in (0, 2):
        ids = loaded.tokenizer.encode(PROMPTS[i])
        assert outs[f"r{i}"].outputs[0].token_ids == hf_reference("qwen2", ids, 10)
    assert_pool_clean(engine)
    # An id may be reused once its request is gone.
    engine.add_request("r1", PROMPTS[1], params)
    engine.abort_request("r1")
    assert_pool_clean(engine)


@pytest.mark.parametrize("ends", ["finished", "aborted"])
def test_a_reused_request_id_reads_its_own_context(ends, tiny_loaded, hf_reference):
    """An id may come back once its request ended: the new request's first small step must not
    continue the old one's dense decode view, even where its prefix hit ends just where the old
    request's context did (12 tokens here: three blocks of 4)."""
    loaded = tiny_loaded("llama")
    engine = make_engine(loaded, max_model_len=64, block_size=4)
    cached = list(range(10, 24))  # 14 tokens: its three full blocks stay cached
    run_all(engine, [cached], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), prefix="cached-")
    # "x" leaves having computed 12 tokens of other content: it finishes (5 + 8 - 1), or is
    # aborted there while a bystander decodes beside it.
    bystander = list(range(200, 203))
    longer = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    if ends == "aborted":
        engine.add_request("bystander", bystander, longer)
    engine.add_request("x", list(range(100, 105)), dataclasses.replace(longer, max_tokens=8))
    while "x" in engine.scheduler.requests and engine.scheduler.requests["x"].num_computed_tokens < 12:
        engine.step()
    engine.abort_request("x")  # a no-op once it finished
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("x", cached, params)  # a 12-token hit, then two tokens: a small first step
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert outs["x"].num_cached_tokens == 12
    assert outs["x"].outputs[0].token_ids == hf_reference("llama", cached, 6)
    if ends == "aborted":
        assert outs["bystander"].outputs[0].token_ids == hf_reference("llama", bystander, 30)
    assert_pool_clean(engine)
