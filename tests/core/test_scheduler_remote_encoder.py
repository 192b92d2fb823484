"""Scheduler with encoder workers (EPD), as plain data: an item a worker is
still encoding stops the window before it; a published one is planned as a
load, counted against encoder-cache space but not the step's compute budget."""

from __future__ import annotations

from omnistage.core.config import SchedulerConfig
from omnistage.core.request import Request
from omnistage.core.scheduler import Scheduler
from omnistage.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from omnistage.sampling_params import SamplingParams

PAD = 5


def _sched(budget: int = 30, cache: int = 90) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=128, max_model_len=256, block_size=4, num_kv_blocks=128,
            encoder_compute_budget=budget, encoder_cache_size=cache,
        )
    )  # fmt: skip


def _req(rid: str, items: list[tuple[int, int, str]], n: int = 40) -> Request:
    prompt = [11 + i % 70 for i in range(n)]
    features = []
    for offset, length, ident in items:
        prompt[offset : offset + length] = [PAD] * length
        features.append(MultiModalFeatureSpec(None, "image", ident, PlaceholderRange(offset, length)))
    return Request(rid, prompt, SamplingParams(max_tokens=2), mm_features=features)


def test_pending_item_stops_the_window_and_ready_items_cost_no_compute_budget():
    sched = _sched(budget=30, cache=90)
    a, b, c = _req("a", [(2, 30, "img-a")]), _req("b", [(4, 30, "img-b")]), _req("c", [(6, 30, "img-c")])
    for r in (a, b, c):
        sched.add_request(r)
    sched.encoder.remote_ready = {"img-a", "img-b"}
    sched.encoder.remote_pending = {"img-c"}
    out = sched.schedule()
    # a and b are loads (60 rows > the 30-row compute budget, within the 90-row cache); c waits for its worker
    assert out.remote_encoder_inputs == {"a": [0], "b": [0]}
    assert out.scheduled_encoder_inputs == {}
    assert out.num_scheduled_tokens == {"a": 40, "b": 40, "c": 6}
    manager = sched.encoder_cache_manager
    assert manager.num_free_slots == 30  # the loads took cache space


def test_item_neither_pending_nor_ready_is_encoded_locally_under_the_budget():
    sched = _sched(budget=30, cache=90)
    a, b = _req("a", [(2, 30, "img-a")]), _req("b", [(4, 30, "img-b")])
    sched.add_request(a)
    sched.add_request(b)
    sched.encoder.remote_ready = {"img-b"}  # a's worker failed: it is not remote any more
    out = sched.schedule()
    assert out.scheduled_encoder_inputs == {"a": [0]} and out.remote_encoder_inputs == {"b": [0]}
    # a ready load never evicts an item this step needs: the cache bounds loads too
    sched = _sched(budget=30, cache=40)
    for r in (_req("a", [(2, 30, "img-a")]), _req("b", [(4, 30, "img-b")])):
        sched.add_request(r)
    sched.encoder.remote_ready = {"img-a", "img-b"}
    out = sched.schedule()
    assert out.remote_encoder_inputs == {"a": [0]} and out.num_scheduled_tokens["b"] == 4


def _finish_prefill(sched: Scheduler, out) -> None:
    """Feed back a sampled token for every request whose prefill completed."""
    from omnistage.core.runner_output import ModelRunnerOutput

    done = {rid: 7 for rid, n in out.num_scheduled_tokens.items()
            if sched.requests[rid].num_computed_tokens == sched.requests[rid].num_tokens}  # fmt: skip
    sched.update_from_output(out, ModelRunnerOutput(req_ids=list(done), sampled_token_ids=done))


def test_request_pending_on_a_worker_does_not_block_the_queue_and_keeps_its_place():
    """An image at the prompt's start still on its worker stops the request at
    0 tokens; the text request and the image request whose item is published,
    both behind it, start past it (without workers they would wait: FCFS).
    Once its item is published it goes first, ahead of a later arrival."""
    sched = _sched(budget=30, cache=90)
    a = _req("a", [(0, 30, "img-a")])
    t = _req("t", [])
    b = _req("b", [(0, 30, "img-b")])
    for r in (a, t, b):
        sched.add_request(r)
    sched.encoder.remote_pending = {"img-a"}
    sched.encoder.remote_ready = {"img-b"}
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"t": 40, "b": 40}
    assert out.remote_encoder_inputs == {"b": [0]}
    assert [r.request_id for r in sched.waiting] == ["a"] and [r.request_id for r in sched.running] == ["t", "b"]
    _finish_prefill(sched, out)
    sched.add_request(_req("c", [(0, 30, "img-c")]))
    sched.encoder.remote_pending = set()
    sched.encoder.remote_ready = {"img-a", "img-c"}
    out = sched.schedule()
    assert [r.request_id for r in sched.waiting] == [] and [r.request_id for r in sched.running] == ["t", "b", "a", "c"]
    assert out.num_scheduled_tokens == {"t": 1, "b": 1, "a": 40, "c": 40}


def test_other_zero_token_stops_still_block_the_queue():
    """A request stopped by the local encoder budget (no worker involved) keeps
    FCFS: nothing behind it starts, as without workers."""
    sched = _sched(budget=30, cache=90)
    a, b, t = _req("a", [(0, 30, "img-a")]), _req("b", [(0, 30, "img-b")]), _req("t", [])
    for r in (a, b, t):
        sched.add_request(r)
    out = sched.schedule()  # a takes the whole 30-row budget; b cannot encode and blocks t
    assert out.num_scheduled_tokens == {"a": 40}
    assert [r.request_id for r in sched.waiting] == ["b", "t"]


def test_preempted_request_goes_back_behind_an_earlier_one_passed_over():
    """Preemption returns a request to its arrival place in the queue: behind an
    earlier request that waits on a worker, ahead of later arrivals."""
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=128, max_model_len=256, block_size=4, num_kv_blocks=12,
            encoder_compute_budget=30, encoder_cache_size=90,
        )
    )  # fmt: skip
    a = _req("a", [(0, 30, "img-a")], n=32)
    t1, t2 = _req("t1", [], n=20), _req("t2", [], n=24)
    for r in (a, t1, t2):
        sched.add_request(r)
    sched.encoder.remote_pending = {"img-a"}
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"t1": 20, "t2": 24}  # 5 + 6 blocks of the 12
    _finish_prefill(sched, out)
    late = _req("late", [], n=8)
    sched.add_request(late)
    # decoding, t1 needs a 6th block and t2 a 7th: 13 > 12, so t2 (the latest admitted) goes
    out = sched.schedule()
    assert "t2" in out.preempted_req_ids
    assert [r.request_id for r in sched.waiting] == ["a", "t2", "late"]
