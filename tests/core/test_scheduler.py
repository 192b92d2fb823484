"""Scheduler: continuous batching, chunked prefill, prefix hits, preemption."""

from __future__ import annotations

import random

import pytest

from omnistage.core.config import SchedulerConfig
from omnistage.core.request import Request, RequestStatus
from omnistage.core.scheduler import Scheduler
from omnistage.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from omnistage.sampling_params import SamplingParams
from omnistage.core.runner_output import ModelRunnerOutput

from core_sim import FakeWorker, assert_pool_clean, reference_output, run_to_completion

BS = 4


def _sched(**kw) -> Scheduler:
    args = dict(max_num_seqs=16, max_num_batched_tokens=64, max_model_len=128, block_size=BS, num_kv_blocks=64)
    args.update(kw)
    return Scheduler(SchedulerConfig(**args))


def _req(rid: str, prompt: list[int], max_tokens: int = 8, **sp) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **sp))


def _workload(n: int = 6, seed: int = 0) -> list[tuple[str, list[int], int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(10, 90) for _ in range(9)]  # a common prefix, so caching matters
    out = []
    for i in range(n):
        tail = [rng.randrange(10, 90) for _ in range(rng.randrange(1, 14))]
        prompt = (shared if i % 2 else []) + tail
        out.append((f"r{i}", prompt, rng.randrange(1, 12)))
    return out


def _run(workload, **kw) -> tuple[dict[str, Request], Scheduler, FakeWorker]:
    sched = _sched(**kw)
    worker = FakeWorker(BS)
    for rid, prompt, max_tokens in workload:
        sched.add_request(_req(rid, prompt, max_tokens))
    done = run_to_completion(sched, worker)
    assert_pool_clean(sched)
    return done, sched, worker


def _check_reference(done: dict[str, Request], workload) -> None:
    assert set(done) == {rid for rid, _, _ in workload}
    for rid, prompt, max_tokens in workload:
        assert done[rid].output_token_ids == reference_output(prompt, max_tokens), rid
        assert done[rid].status is RequestStatus.FINISHED_LENGTH


def test_single_request_lifecycle():
    sched = _sched()
    req = _req("a", [11, 12, 13, 14], max_tokens=3)
    sched.add_request(req)
    assert sched.has_unfinished_requests() and sched.get_stats().num_waiting == 1
    out = sched.schedule()
    assert [n.req_id for n in out.scheduled_new_reqs] == ["a"]
    new = out.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 0 and new.token_ids == [11, 12, 13, 14] and len(new.block_ids) == 1
    assert out.num_scheduled_tokens == {"a": 4} and req.num_computed_tokens == 4  # advanced at schedule
    assert req.num_cached_tokens == 0 and req.first_scheduled_time is not None
    assert sched.update_from_output(out, ModelRunnerOutput(["a"], {"a": 40})) == [req]
    out = sched.schedule()
    cached = out.scheduled_cached_reqs[0]
    assert cached.num_computed_tokens == 4  # the value before this step
    assert len(cached.new_block_ids) == 1 and out.num_scheduled_tokens == {"a": 1}  # position 4: block 1
    sched.update_from_output(out, ModelRunnerOutput(["a"], {"a": 41}))
    out = sched.schedule()
    assert out.scheduled_cached_reqs[0].new_block_ids == []
    sched.update_from_output(out, ModelRunnerOutput(["a"], {"a": 42}))
    assert req.status is RequestStatus.FINISHED_LENGTH and req.output_token_ids == [40, 41, 42]
    assert not sched.has_unfinished_requests() and sched.get_stats().num_running == 0
    assert sched.schedule().finished_req_ids == {"a"}
    assert sched.schedule().finished_req_ids == set()  # reported once
    assert_pool_clean(sched)


def test_many_requests_match_reference():
    wl = _workload(8)
    done, sched, _ = _run(wl)
    _check_reference(done, wl)
    assert sched.get_stats().prefix_cache_hit_tokens > 0


@pytest.mark.parametrize("budget", [1, 7, 64])
@pytest.mark.parametrize("caching", [True, False])
def test_chunked_prefill_budgets(budget, caching):
    wl = _workload(5, seed=budget)
    done, _, worker = _run(wl, max_num_batched_tokens=budget, enable_prefix_caching=caching)
    _check_reference(done, wl)
    progress: dict[str, int] = {}
    for out in worker.steps:
        assert 1 <= out.total_num_scheduled_tokens <= budget
        for data in out.scheduled_new_reqs + out.scheduled_cached_reqs:
            if data in out.scheduled_cached_reqs:
                assert data.num_computed_tokens == progress[data.req_id]
            progress[data.req_id] = data.num_computed_tokens + out.num_scheduled_tokens[data.req_id]
    if budget == 1:
        assert all(out.total_num_scheduled_tokens == 1 for out in worker.steps)


def test_long_prompt_is_split_and_samples_only_at_the_end():
    sched = _sched(max_num_batched_tokens=6)
    worker = FakeWorker(BS)
    sched.add_request(_req("a", list(range(10, 27)), max_tokens=2))  # 17 tokens: 6 + 6 + 5
    chunks, sampled = [], []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        res = worker.execute(out)
        chunks.append(out.num_scheduled_tokens.get("a", 0))
        sampled.append("a" in res.sampled_token_ids)
        sched.update_from_output(out, res)
    assert chunks == [6, 6, 5, 1] and sampled == [False, False, True, True]


def test_long_prefill_token_threshold_caps_each_request():
    sched = _sched(max_num_batched_tokens=64, long_prefill_token_threshold=5)
    sched.add_request(_req("a", list(range(10, 22))))
    sched.add_request(_req("b", list(range(30, 42))))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 5, "b": 5}


def test_decode_and_prefill_mixed_in_one_step_running_first():
    sched = _sched(max_num_batched_tokens=8)
    worker = FakeWorker(BS)
    sched.add_request(_req("a", [11, 12, 13]))
    out = sched.schedule()
    sched.update_from_output(out, worker.execute(out))
    sched.add_request(_req("b", list(range(20, 40))))
    out = sched.schedule()
    assert [c.req_id for c in out.scheduled_cached_reqs] == ["a"]
    assert [n.req_id for n in out.scheduled_new_reqs] == ["b"]
    assert out.num_scheduled_tokens == {"a": 1, "b": 7}  # decode first, prefill gets the rest
    res = worker.execute(out)
    assert set(res.sampled_token_ids) == {"a"}  # b's partial chunk samples nothing
    sched.update_from_output(out, res)


def test_max_num_seqs_limits_running():
    sched = _sched(max_num_seqs=2)
    for i in range(4):
        sched.add_request(_req(f"r{i}", [11, 12]))
    out = sched.schedule()
    assert set(out.num_scheduled_tokens) == {"r0", "r1"}
    assert sched.get_stats().num_running == 2 and sched.get_stats().num_waiting == 2


def test_prefix_hit_through_scheduler_and_generated_blocks():
    sched = _sched()
    worker = FakeWorker(BS)
    a = _req("a", list(range(10, 20)), max_tokens=6)
    sched.add_request(a)
    run_to_completion(sched, worker)
    # Same prompt: hit the 2 full prompt blocks (8 of 10 tokens).
    b = _req("b", list(range(10, 20)), max_tokens=2)
    # Prompt plus a's outputs: also hits the block a filled with generated tokens.
    c = _req("c", a.all_token_ids + [77], max_tokens=2)
    sched.add_request(b)
    sched.add_request(c)
    out = sched.schedule()
    hits = {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs}
    assert hits == {"b": 8, "c": 12}  # a's 15 computed tokens: 3 full blocks
    assert out.num_scheduled_tokens == {"b": 2, "c": 5}
    assert (b.num_cached_tokens, c.num_cached_tokens) == (8, 12)
    sched.update_from_output(out, worker.execute(out))  # the fake worker checks the hit KV
    run_to_completion(sched, worker)
    assert b.output_token_ids == reference_output(b.prompt_token_ids, 2)
    stats = sched.get_stats()
    assert (stats.prefix_cache_query_tokens, stats.prefix_cache_hit_tokens) == (10 + 10 + 17, 20)
    sched.reset_prefix_cache()
    sched.add_request(_req("d", list(range(10, 20))))
    assert sched.schedule().scheduled_new_reqs[0].num_computed_tokens == 0


def test_identical_prompts_admitted_together_share_nothing_until_computed():
    sched = _sched()
    worker = FakeWorker(BS)
    sched.add_request(_req("a", list(range(10, 20))))
    sched.add_request(_req("b", list(range(10, 20))))
    out = sched.schedule()
    assert [n.num_computed_tokens for n in out.scheduled_new_reqs] == [0, 0]
    sched.update_from_output(out, worker.execute(out))
    run_to_completion(sched, worker)
    assert_pool_clean(sched)


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("num_blocks, budget", [(8, 64), (6, 5), (5, 3)])
def test_preemption_under_tiny_pool_matches_big_pool(caching, num_blocks, budget):
    wl = [(f"r{i}", [10 + i, 20, 30, 40, 50, 60][: 3 + i % 4], 10) for i in range(6)]
    big, _, _ = _run(wl, enable_prefix_caching=caching, max_model_len=20)
    small, sched, worker = _run(
        wl, enable_prefix_caching=caching, num_kv_blocks=num_blocks, max_num_batched_tokens=budget, max_model_len=20
    )
    assert sched.get_stats().num_preemptions > 0
    assert {r: q.output_token_ids for r, q in small.items()} == {r: q.output_token_ids for r, q in big.items()}
    _check_reference(small, wl)
    assert sum(q.num_preemptions for q in small.values()) == sched.num_preemptions
    # A resumed request comes back as a new request carrying all its known tokens.
    preempted = set().union(*(out.preempted_req_ids for out in worker.steps))
    resumed = [n for out in worker.steps for n in out.scheduled_new_reqs if n.req_id in preempted]
    assert any(len(n.token_ids) > n.num_prompt_tokens for n in resumed)


def test_preemption_picks_latest_arrival_and_resumes_it_first():
    sched = _sched(num_kv_blocks=4, max_model_len=16)
    worker = FakeWorker(BS)
    for rid in ("a", "b", "c"):
        sched.add_request(_req(rid, [11, 12, 13, 14], max_tokens=8))
    sched.add_request(_req("d", [15], max_tokens=1))
    out = sched.schedule()  # a, b, c: one block each; d one block
    assert set(out.num_scheduled_tokens) == {"a", "b", "c", "d"}
    sched.update_from_output(out, worker.execute(out))  # d finishes; a, b, c need a second block
    sched.add_request(_req("e", [16], max_tokens=1))  # arrived after c: c must resume first
    out = sched.schedule()
    assert out.preempted_req_ids == {"c"} and not out.scheduled_new_reqs
    assert [w.request_id for w in sched.waiting] == ["c", "e"]
    assert sched.requests["c"].status is RequestStatus.PREEMPTED
    sched.update_from_output(out, worker.execute(out))
    done = run_to_completion(sched, worker)
    first_new = [n.req_id for o in worker.steps[2:] for n in o.scheduled_new_reqs]
    assert first_new.index("c") < first_new.index("e")
    assert done["c"].output_token_ids == reference_output([11, 12, 13, 14], 8)
    assert_pool_clean(sched)


def test_lone_request_that_cannot_get_a_block_is_a_config_error():
    sched = _sched(num_kv_blocks=2, max_model_len=64)
    worker = FakeWorker(BS)
    req = _req("big", [11, 12, 13], max_tokens=4)
    sched.add_request(req)
    req.sampling_params.max_tokens = 20  # bypass add_request's check to reach the runtime guard
    with pytest.raises(RuntimeError, match="'big'.*num_kv_blocks"):
        for _ in range(20):
            out = sched.schedule()
            sched.update_from_output(out, worker.execute(out))


def test_missing_sampled_token_raises_instead_of_hanging():
    sched = _sched()
    sched.add_request(_req("a", [11, 12]))
    out = sched.schedule()
    with pytest.raises(RuntimeError, match="'a'"):
        sched.update_from_output(out, ModelRunnerOutput())


def test_waiting_head_blocked_while_pool_is_held():
    sched = _sched(num_kv_blocks=4, max_model_len=16)
    worker = FakeWorker(BS)
    sched.add_request(_req("long", list(range(10, 21)), max_tokens=2))  # 3 blocks, still running
    out = sched.schedule()
    sched.update_from_output(out, worker.execute(out))
    sched.add_request(_req("mid", list(range(30, 38)), max_tokens=1))  # needs 2 of the 1 left
    sched.add_request(_req("small", [40], max_tokens=1))
    out = sched.schedule()
    assert set(out.num_scheduled_tokens) == {"long"}  # FCFS: small does not jump the queue
    sched.update_from_output(out, worker.execute(out))
    run_to_completion(sched, worker)
    assert_pool_clean(sched)


def _mm_req(rid: str, ident: str, salt: str | None = None) -> Request:
    feat = MultiModalFeatureSpec(None, "image", ident, PlaceholderRange(offset=2, length=4))
    prompt = [11, 12, 5, 5, 5, 5, 13, 14, 15]  # placeholder tokens 5 at [2, 6)
    return Request(rid, prompt, SamplingParams(max_tokens=1), mm_features=[feat], cache_salt=salt)


@pytest.mark.parametrize(
    "first, second, expected_hit",
    [
        (("a", "img-1", None), ("b", "img-1", None), 8),  # same image: both blocks hit
        (("a", "img-1", None), ("b", "img-2", None), 0),  # other image behind the same tokens
        (("a", "img-1", "s1"), ("b", "img-1", "s2"), 0),  # other salt
        (("a", "img-1", "s1"), ("b", "img-1", "s1"), 8),
    ],
)
def test_multimodal_identifiers_and_salt_key_the_cache(first, second, expected_hit):
    sched = _sched(encoder_compute_budget=16, encoder_cache_size=16)
    worker = FakeWorker(BS)
    sched.add_request(_mm_req(*first))
    run_to_completion(sched, worker)
    sched.add_request(_mm_req(*second))
    out = sched.schedule()
    new = out.scheduled_new_reqs[0]
    assert new.num_computed_tokens == expected_hit and len(new.mm_features) == 1
    # the item lies inside the hit blocks, or its output is still in the encoder cache
    # (keyed by content alone); only the other image is encoded
    assert out.scheduled_encoder_inputs == ({"b": [0]} if second[1] != first[1] else {})
    sched.update_from_output(out, worker.execute(out))
    assert_pool_clean(sched)
