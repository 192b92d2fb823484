"""Scheduler request handling: validation, stop conditions, finish and abort."""

from __future__ import annotations

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
    args = dict(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=32, block_size=BS, num_kv_blocks=16)
    args.update(kw)
    return Scheduler(SchedulerConfig(**args))


def _req(rid: str, prompt: list[int], max_tokens: int | None = 8, eos: int | None = None, **sp) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **sp), eos_token_id=eos)


def _scripted(tokens: list[int]):
    """A 'model' that emits ``tokens`` in order, whatever the input."""
    it = iter(tokens)
    return lambda _history: next(it)


def _generate(req: Request, script: list[int], **kw) -> Request:
    sched = _sched(**kw)
    sched.add_request(req)
    run_to_completion(sched, FakeWorker(BS, sample=_scripted(script)))
    assert_pool_clean(sched)
    return req


# -- validation ----------------------------------------------------------------


def _img(offset: int, length: int, ident: str = "img") -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(None, "image", ident, PlaceholderRange(offset, length))


@pytest.mark.parametrize(
    "make, config, match",
    [
        (lambda: _req("bad", []), {}, "'bad'.*empty"),
        (lambda: _req("bad", [1] * 33), {}, "'bad'.*33 tokens.*max_model_len=32"),
        (lambda: Request("bad", [1] * 10, SamplingParams(), max_model_len=8), {}, "'bad'.*max_model_len=8"),
        (lambda: _req("bad", [1] * 20), {"num_kv_blocks": 4}, "'bad'.*KV blocks.*pool"),
        (lambda: Request("bad", [1] * 8, SamplingParams(), mm_features=[_img(2, 4), _img(4, 2)]), {}, "mm_features"),
        (lambda: Request("bad", [1] * 8, SamplingParams(), mm_features=[_img(6, 4)]), {}, "'bad'.*mm_features\\[0\\]"),
    ],
)
def test_bad_input_raises_and_leaves_others_served(make, config, match):
    sched = _sched(**config)
    worker = FakeWorker(BS)
    good = _req("good", [11, 12, 13], max_tokens=3)
    sched.add_request(good)
    out = sched.schedule()
    sched.update_from_output(out, worker.execute(out))
    with pytest.raises(ValueError, match=match):
        sched.add_request(make())
    assert "bad" not in sched.requests and sched.get_num_unfinished_requests() == 1
    done = run_to_completion(sched, worker)
    assert done["good"].output_token_ids == reference_output([11, 12, 13], 3)
    assert_pool_clean(sched)


def test_prompt_that_fits_the_pool_only_without_generation_is_refused():
    sched = _sched(num_kv_blocks=4)  # 16 tokens of KV
    sched.add_request(_req("ok", [1] * 16, max_tokens=1))  # the sampled token needs no KV
    with pytest.raises(ValueError, match="'long'.*up to 5 KV blocks"):
        sched.add_request(_req("long", [1] * 16, max_tokens=2))


def test_duplicate_id_and_reused_request_refused():
    sched = _sched()
    req = _req("a", [11])
    sched.add_request(req)
    with pytest.raises(ValueError, match="'a'.*unique"):
        sched.add_request(_req("a", [12]))
    sched.schedule()
    with pytest.raises(ValueError, match="'a'"):
        sched.add_request(req)


def test_config_validation():
    with pytest.raises(ValueError, match="block_size"):
        SchedulerConfig(block_size=0)
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        SchedulerConfig(long_prefill_token_threshold=-1)
    with pytest.raises(ValueError, match="num_kv_blocks"):
        SchedulerConfig(num_kv_blocks=True)


def test_prompt_plus_max_tokens_beyond_max_model_len_stops_at_length():
    req = _generate(_req("a", [11] * 30, max_tokens=10), list(range(100, 110)))
    assert req.status is RequestStatus.FINISHED_LENGTH and req.num_tokens == 32
    assert req.output_token_ids == [100, 101]
    req = _generate(_req("b", [11] * 32, max_tokens=None), [100])  # prompt == max_model_len: one token
    assert req.output_token_ids == [100] and req.status is RequestStatus.FINISHED_LENGTH


# -- stop conditions -------------------------------------------------------------


def test_eos_stops():
    req = _generate(_req("a", [11, 12], eos=2), [50, 51, 2, 52])
    assert req.output_token_ids == [50, 51, 2]
    assert req.status is RequestStatus.FINISHED_STOPPED and req.stop_reason is None
    assert req.status.finish_reason == "stop"


def test_ignore_eos_runs_to_max_tokens():
    req = _generate(_req("a", [11, 12], max_tokens=4, eos=2, ignore_eos=True), [2, 2, 2, 2, 2])
    assert req.output_token_ids == [2, 2, 2, 2] and req.status is RequestStatus.FINISHED_LENGTH


def test_min_tokens_defers_eos_and_stop_tokens():
    req = _generate(_req("a", [11], eos=2, min_tokens=3, stop_token_ids=[7]), [2, 7, 2, 9])
    assert req.output_token_ids == [2, 7, 2] and req.status is RequestStatus.FINISHED_STOPPED
    req = _generate(_req("b", [11], eos=2, min_tokens=2, stop_token_ids=[7]), [2, 7, 9])
    assert req.output_token_ids == [2, 7] and req.stop_reason == 7


def test_stop_token_ids():
    req = _generate(_req("a", [11], stop_token_ids=[5, 6], eos=2), [40, 6, 41])
    assert req.output_token_ids == [40, 6]
    assert req.status is RequestStatus.FINISHED_STOPPED and req.stop_reason == 6


def test_stop_token_on_last_allowed_token_is_a_stop():
    req = _generate(_req("a", [11], max_tokens=2, stop_token_ids=[6]), [40, 6])
    assert req.status is RequestStatus.FINISHED_STOPPED


def test_max_tokens():
    req = _generate(_req("a", [11], max_tokens=3, eos=2), [40, 41, 42, 43])
    assert req.output_token_ids == [40, 41, 42] and req.status.finish_reason == "length"


def test_max_model_len_per_request():
    req = Request("a", [11, 12], SamplingParams(max_tokens=None), max_model_len=5)
    _generate(req, list(range(40, 50)))
    assert req.num_tokens == 5 and req.status is RequestStatus.FINISHED_LENGTH


# -- finish and abort ----------------------------------------------------------------


def test_finish_requests_for_stop_strings():
    sched = _sched()
    worker = FakeWorker(BS)
    sched.add_request(_req("a", [11, 12]))
    sched.add_request(_req("b", [13, 14]))
    out = sched.schedule()
    sched.update_from_output(out, worker.execute(out))
    sched.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)
    with pytest.raises(ValueError, match="finished status"):
        sched.finish_requests("b", RequestStatus.RUNNING)
    out = sched.schedule()
    assert out.finished_req_ids == {"a"} and out.aborted_req_ids == set()
    assert set(out.num_scheduled_tokens) == {"b"}
    sched.update_from_output(out, worker.execute(out))
    run_to_completion(sched, worker)
    assert_pool_clean(sched)


def test_abort_in_every_state():
    # max_num_seqs=3 keeps w waiting; a pool of 4 blocks forces a preemption.
    sched = _sched(num_kv_blocks=4, max_model_len=16, max_num_seqs=3)
    worker = FakeWorker(BS)
    for rid in ("r0", "r1", "r2", "w"):
        sched.add_request(_req(rid, [11, 12, 13, 14], max_tokens=3))
    out = sched.schedule()  # r0, r1, r2 take a block each
    sched.update_from_output(out, worker.execute(out))
    out = sched.schedule()  # each needs a second block, one is free: r2 is preempted
    assert out.preempted_req_ids == {"r2"}
    sched.update_from_output(out, worker.execute(out))
    states = {rid: sched.requests[rid].status for rid in sched.requests}
    preempted = [rid for rid, st in states.items() if st is RequestStatus.PREEMPTED]
    running = [rid for rid, st in states.items() if st is RequestStatus.RUNNING]
    waiting = [rid for rid, st in states.items() if st is RequestStatus.WAITING]
    assert preempted and running and waiting, states
    victims = [preempted[0], running[0], waiting[0], "unknown"]
    sched.abort_requests(victims)
    sched.abort_requests(victims)  # twice: ignored
    out = sched.schedule()
    assert out.aborted_req_ids == {running[0]}  # only the worker's rows need dropping
    for rid in victims[:3]:
        assert rid not in sched.requests and rid not in out.num_scheduled_tokens
    sched.update_from_output(out, worker.execute(out))
    run_to_completion(sched, worker)
    assert_pool_clean(sched)


def test_abort_between_schedule_and_update():
    sched = _sched()
    worker = FakeWorker(BS)
    sched.add_request(_req("a", [11, 12]))
    sched.add_request(_req("b", [13, 14]))
    out = sched.schedule()
    res = worker.execute(out)
    sched.abort_requests("a")
    updated = sched.update_from_output(out, res)
    assert [r.request_id for r in updated] == ["b"]
    assert sched.schedule().aborted_req_ids == {"a"}
    sched.abort_requests(["b"])
    assert not sched.has_unfinished_requests()
    assert_pool_clean(sched)


def test_update_returns_new_tokens_and_finishes():
    sched = _sched()
    a, b = _req("a", [11], max_tokens=1), _req("b", [12], max_tokens=2)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    updated = sched.update_from_output(out, ModelRunnerOutput(["a", "b"], {"a": 40, "b": 41}))
    assert updated == [a, b] and a.finished and not b.finished
    assert sched.get_stats().num_running == 1
