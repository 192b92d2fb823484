"""Scheduler + EncoderCacheManager: which items are encoded in which step.

A fake worker keeps encoder outputs by identifier the way the real one does
(frees the evicted ids first, then encodes the scheduled items) and checks
that every item overlapping a step's window is available when it is read.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from omnistage.core.config import SchedulerConfig
from omnistage.core.request import Request
from omnistage.core.scheduler import Scheduler
from omnistage.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from omnistage.sampling_params import SamplingParams

from core_sim import FakeWorker, assert_pool_clean, reference_output, run_to_completion

BS = 4
PAD = 5  # the placeholder token


@dataclass
class EncoderWorker(FakeWorker):
    outputs: set[str] = field(default_factory=set)
    features: dict[str, list[MultiModalFeatureSpec]] = field(default_factory=dict)
    encoded: list[str] = field(default_factory=list)
    per_step: list[list[str]] = field(default_factory=list)

    def execute(self, out):
        for mm_hash in out.free_encoder_mm_hashes:
            self.outputs.discard(mm_hash)
        for rid in out.finished_req_ids | out.aborted_req_ids | out.preempted_req_ids:
            self.features.pop(rid, None)
        for new in out.scheduled_new_reqs:
            self.features[new.req_id] = new.mm_features
        step = []
        for rid, inputs in out.scheduled_encoder_inputs.items():
            for k in inputs:
                ident = self.features[rid][k].identifier
                assert ident not in step, f"{ident} encoded twice in one step"
                step.append(ident)
                self.outputs.add(ident)
        self.encoded.extend(step)
        self.per_step.append(step)
        starts = {r.req_id: r.num_computed_tokens for r in [*out.scheduled_new_reqs, *out.scheduled_cached_reqs]}
        for rid, n in out.num_scheduled_tokens.items():
            start, end = starts[rid], starts[rid] + n
            for f in self.features[rid]:
                pos = f.mm_position
                if pos.offset < end and start < pos.offset + pos.length:
                    assert f.identifier in self.outputs, f"{rid}: miss on {f.identifier} in window [{start}, {end})"
        return super().execute(out)


def _sched(**kw) -> Scheduler:
    args = dict(
        max_num_seqs=16, max_num_batched_tokens=64, max_model_len=256, block_size=BS, num_kv_blocks=128,
        encoder_compute_budget=64, encoder_cache_size=64,
    )  # fmt: skip
    args.update(kw)
    return Scheduler(SchedulerConfig(**args))


def _req(rid: str, text: list[int], items: list[tuple[int, int, str]], max_tokens: int = 3) -> Request:
    """``text`` token ids with item spans ``(offset, length, identifier)``
    overwritten by placeholder tokens."""
    prompt = list(text)
    features = []
    for offset, length, ident in items:
        prompt[offset : offset + length] = [PAD] * length
        features.append(MultiModalFeatureSpec(None, "image", ident, PlaceholderRange(offset, length)))
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), mm_features=features)


def _text(n: int, seed: int) -> list[int]:
    return [11 + (seed * 7 + i * 13) % 80 for i in range(n)]


def _check_outputs(done, requests) -> None:
    for r in requests:
        assert done[r.request_id].output_token_ids == reference_output(r.prompt_token_ids, r.sampling_params.max_tokens)


def _assert_no_references(sched: Scheduler) -> None:
    manager = sched.encoder_cache_manager
    assert manager.num_referenced_entries == 0 and not manager._holders
    assert manager.num_freeable_slots == manager.cache_size


def test_item_larger_than_the_token_budget_is_encoded_once():
    sched = _sched(max_num_batched_tokens=8, encoder_compute_budget=40, encoder_cache_size=40)
    worker = EncoderWorker(BS)
    req = _req("a", _text(40, 0), [(3, 30, "big")])
    sched.add_request(req)
    done = run_to_completion(sched, worker)
    _check_outputs(done, [req])
    assert worker.encoded == ["big"]
    assert worker.per_step[0] == ["big"]  # the first window [0, 8) already reaches the item
    _assert_no_references(sched)
    assert_pool_clean(sched)


def test_window_stops_before_an_item_that_does_not_fit():
    sched = _sched(encoder_compute_budget=30, encoder_cache_size=30)
    worker = EncoderWorker(BS)
    a = _req("a", _text(40, 1), [(2, 30, "img-a")])
    b = _req("b", _text(40, 2), [(6, 30, "img-b")])
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 40, "b": 6}  # b stops just before its item
    assert out.scheduled_encoder_inputs == {"a": [0]}
    sched.update_from_output(out, worker.execute(out))
    out = sched.schedule()  # a's item is computed and released: b's evicts it
    assert out.scheduled_encoder_inputs == {"b": [0]} and out.num_scheduled_tokens["b"] == 34
    sched.update_from_output(out, worker.execute(out))
    done = run_to_completion(sched, worker)
    done.update({"a": a})
    _check_outputs({**done, "b": b}, [a, b])
    _assert_no_references(sched)


def test_compute_budget_limits_the_encodes_of_a_step():
    sched = _sched(encoder_compute_budget=30, encoder_cache_size=100)
    worker = EncoderWorker(BS)
    reqs = [_req(f"r{i}", _text(24, i), [(1, 20, f"img-{i}")]) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    assert out.scheduled_encoder_inputs == {"r0": [0]}
    assert out.num_scheduled_tokens == {"r0": 24, "r1": 1, "r2": 1}
    sched.update_from_output(out, worker.execute(out))
    done = run_to_completion(sched, worker)
    _check_outputs(done, reqs)
    assert [s for s in worker.per_step if s] == [["img-0"], ["img-1"], ["img-2"]]
    _assert_no_references(sched)


def test_equal_content_is_encoded_once():
    sched = _sched()
    worker = EncoderWorker(BS)
    reqs = [
        _req("a", _text(30, 3), [(2, 8, "same"), (14, 8, "same")]),  # the same image twice in one prompt
        _req("b", _text(30, 4), [(5, 8, "same")]),  # and in another request of the same step
    ]
    for r in reqs:
        sched.add_request(r)
    done = run_to_completion(sched, worker)
    _check_outputs(done, reqs)
    assert worker.encoded == ["same"]
    _assert_no_references(sched)


def test_different_content_behind_identical_tokens_shares_nothing():
    sched = _sched()
    worker = EncoderWorker(BS)
    text = _text(30, 5)
    a, b = _req("a", text, [(8, 12, "img-1")]), _req("b", text, [(8, 12, "img-2")])
    assert a.prompt_token_ids == b.prompt_token_ids
    sched.add_request(a)
    run_to_completion(sched, worker)
    sched.add_request(b)
    out = sched.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 8  # the blocks before the item only
    assert out.scheduled_encoder_inputs == {"b": [0]}
    assert sched.encoder_cache_manager.entry_size.keys() == {"img-1", "img-2"}
    sched.update_from_output(out, worker.execute(out))
    run_to_completion(sched, worker)
    _assert_no_references(sched)


def test_admission_refuses_an_item_larger_than_the_cache():
    sched = _sched(encoder_compute_budget=16, encoder_cache_size=16)
    worker = EncoderWorker(BS)
    good = _req("good", _text(20, 6), [(2, 10, "ok")])
    sched.add_request(good)
    message = (
        r"request 'huge': image item 1 \(mm_features\[1\]\) has 17 encoder embeddings, "
        r"more than the encoder cache and budget hold \(16\)"
    )
    with pytest.raises(ValueError, match=message):
        sched.add_request(_req("huge", _text(60, 7), [(2, 10, "ok"), (20, 17, "big")]))
    assert "huge" not in sched.requests
    _check_outputs(run_to_completion(sched, worker), [good])
    text_only = Scheduler(SchedulerConfig(block_size=BS))
    with pytest.raises(ValueError, match=r"request 'x': image item 0: this model takes no multimodal input"):
        text_only.add_request(_req("x", _text(20, 8), [(2, 10, "ok")]))


def test_retention_off_drops_entries_with_their_last_user():
    sched = _sched(retain_encoder_outputs=False, enable_prefix_caching=False)
    worker = EncoderWorker(BS)
    sched.add_request(_req("a", _text(20, 9), [(2, 10, "img")]))
    run_to_completion(sched, worker)
    assert "img" not in sched.encoder_cache_manager
    sched.add_request(_req("b", _text(20, 10), [(2, 10, "img")]))
    out = sched.schedule()
    assert out.scheduled_encoder_inputs == {"b": [0]}  # encoded again
    assert out.free_encoder_mm_hashes == []  # re-allocated in the same pass: the worker keeps the tensor id
    sched.update_from_output(out, worker.execute(out))
    run_to_completion(sched, worker)
    assert worker.encoded == ["img", "img"]
    assert worker.outputs == set()  # b's item was released after its step, and the worker told


@pytest.mark.parametrize("seed", range(6))
def test_random_workload_with_preemption_and_aborts(seed):
    """Small KV pool and encoder cache, chunked prefill, shared items,
    preemption and aborts: every window finds its items, outputs are right,
    nothing stays referenced."""
    rng = random.Random(seed)
    sched = _sched(
        max_num_batched_tokens=rng.choice([5, 8, 16, 32]),
        num_kv_blocks=14,
        encoder_compute_budget=24,
        encoder_cache_size=rng.choice([24, 40]),
        enable_prefix_caching=rng.random() < 0.7,
        retain_encoder_outputs=rng.random() < 0.7,
    )
    worker = EncoderWorker(BS)
    idents = [f"img-{i}" for i in range(4)]
    reqs = []
    for i in range(10):
        n = rng.randint(12, 40)
        items, pos = [], rng.randint(0, 3)
        while pos + 4 < n and len(items) < 2:
            length = rng.randint(2, min(20, n - pos - 1))
            items.append((pos, length, rng.choice(idents)))
            pos += length + rng.randint(1, 4)
        reqs.append(_req(f"r{i}", _text(n, rng.randint(0, 3)), items, max_tokens=rng.randint(1, 6)))
    aborted = set()
    done = {}
    pending = list(reqs)
    for step in range(5000):
        if pending and rng.random() < 0.8:
            sched.add_request(pending.pop(0))
        if not sched.has_unfinished_requests() and not pending:
            break
        if sched.has_unfinished_requests() and rng.random() < 0.03:
            victim = rng.choice([*sched.running, *sched.waiting]).request_id
            sched.abort_requests(victim)
            aborted.add(victim)
        out = sched.schedule()
        for r in sched.update_from_output(out, worker.execute(out)):
            if r.finished:
                done[r.request_id] = r
    assert not sched.has_unfinished_requests()
    _check_outputs(done, [r for r in reqs if r.request_id not in aborted])
    _assert_no_references(sched)
    assert_pool_clean(sched)
