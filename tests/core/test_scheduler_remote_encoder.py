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
