"""Scheduler with a worker-side drafter (EAGLE): drafts the worker proposes are
scheduled the next step, KV slots are reserved for the drafter's look-ahead
when free, and a drafter's boundary item (the one starting where a window
ends) is encoded early when the budgets allow, and otherwise never stalls.

A fake worker stands in for the model: its "drafter" proposes the reference
continuation (all accepted) or wrong tokens (all rejected), and it checks
that every item a window reads is available and records whether the boundary
item was, as the drafter's look-ahead gather would see it.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

import pytest
from core_sim import assert_pool_clean, reference_output, run_to_completion
from test_scheduler_mm import BS, EncoderWorker, _req, _sched, _text

from omnistage.core.spec_decode import SpeculativeConfig

EAGLE = SpeculativeConfig.from_dict(
    {"method": "eagle", "model": "/unused", "num_speculative_tokens": 3}
)


@dataclass
class DraftingWorker(EncoderWorker):
    """Verifies drafts like the real worker (greedy: accept while equal to the
    reference token) and proposes drafts for the requests asked."""

    right: bool = True
    boundary_served: int = 0
    boundary_fallback: int = 0
    asked: list[dict[str, int]] = field(default_factory=list)

    def execute(self, out):
        drafts = out.scheduled_spec_decode_tokens
        self.asked.append(dict(out.draft_token_requests))
        # Strip the drafts: the base worker computes the known tokens only.
        known = {
            rid: n - len(drafts.get(rid, ()))
            for rid, n in out.num_scheduled_tokens.items()
        }
        stripped = dataclasses.replace(
            out,
            num_scheduled_tokens=known,
            total_num_scheduled_tokens=sum(known.values()),
        )
        starts = {
            r.req_id: r.num_computed_tokens
            for r in [*out.scheduled_new_reqs, *out.scheduled_cached_reqs]
        }
        result = super().execute(stripped)
        self._look_ahead(stripped, starts)
        spec: dict[str, list[int]] = {}
        for rid, d in drafts.items():
            row = self.rows[rid]
            emitted = [result.sampled_token_ids[rid]]
            for t in d:  # row.tokens holds the first emitted token already
                if t != emitted[-1]:
                    break
                row.tokens.append(self.sample(row.tokens))
                emitted.append(row.tokens[-1])
            for pos in range(
                row.num_computed, row.num_computed + len(emitted) - 1
            ):  # the accepted drafts' KV
                self.kv.setdefault(row.block_ids[pos // self.block_size], {})[
                    pos % self.block_size
                ] = tuple(row.tokens[: pos + 1])
            row.num_computed += len(emitted) - 1
            spec[rid] = emitted
            result.sampled_token_ids[rid] = emitted[-1]
        result.spec_sampled_token_ids = spec
        result.draft_token_ids = {
            rid: self._propose(self.rows[rid].tokens, k)
            for rid, k in out.draft_token_requests.items()
        }
        return result

    def _propose(self, tokens: list[int], k: int) -> list[int]:
        good = reference_output(tokens, k)
        return good if self.right else [t + 1 for t in good]

    def _look_ahead(self, out, starts) -> None:
        for rid, n in out.num_scheduled_tokens.items():
            end = starts[rid] + n
            for f in self.features[rid]:
                if f.mm_position.offset == end:
                    if f.identifier in self.outputs:
                        self.boundary_served += 1
                    else:
                        self.boundary_fallback += 1


@pytest.mark.parametrize("right", [True, False])
def test_worker_drafts_are_verified_and_outputs_do_not_change(right):
    sched = _sched(speculative_config=EAGLE, max_num_batched_tokens=16)
    worker = DraftingWorker(BS, right=right)
    # Long enough for the right drafter's probes to raise its estimate past the policy's bar.
    reqs = [_req(f"r{i}", _text(10 + 3 * i, i), [], max_tokens=16) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    done = run_to_completion(sched, worker)
    for r in reqs:
        assert done[r.request_id].output_token_ids == reference_output(
            r.prompt_token_ids, 16
        )
    stats = sched.get_stats()
    if right:
        assert stats.num_draft_tokens > 0
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    else:  # only probes were asked for, and a probe is scored in the shadow, never verified
        assert stats.num_draft_tokens == 0
    assert any(worker.asked)
    assert_pool_clean(sched)


def test_boundary_item_is_encoded_early_when_the_budget_allows():
    """A window of 8 that ends exactly where the image starts: the image is
    encoded in that step already."""
    sched = _sched(speculative_config=EAGLE, max_num_batched_tokens=8)
    worker = DraftingWorker(BS)
    req = _req("a", _text(30, 0), [(8, 12, "img")])
    sched.add_request(req)
    run_to_completion(sched, worker)
    assert worker.per_step[0] == ["img"]
    assert worker.boundary_served == 1 and worker.boundary_fallback == 0


def test_boundary_item_counts_the_rows_of_items_loaded_in_the_same_window():
    """With encoder workers: an item a worker published inside the window is loaded (cache
    rows, no compute budget); the boundary item behind it is taken early only if the cache
    holds both (here it does not: 6 + 12 rows > 15), and never while a worker encodes it."""
    sched = _sched(speculative_config=EAGLE, max_num_batched_tokens=8, encoder_compute_budget=15,
                   encoder_cache_size=15)  # fmt: skip
    sched.add_request(_req("r", _text(30, 0), [(2, 6, "a"), (8, 12, "b")]))
    sched.encoder.remote_ready = {"a"}
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"r": 8} and out.remote_encoder_inputs == {"r": [0]}
    assert not out.scheduled_encoder_inputs
    sched = _sched(speculative_config=EAGLE, max_num_batched_tokens=8, encoder_compute_budget=30,
                   encoder_cache_size=30)  # fmt: skip
    sched.add_request(_req("r", _text(30, 0), [(2, 6, "a"), (8, 12, "b")]))
    sched.encoder.remote_ready, sched.encoder.remote_pending = {"a"}, {"b"}
    out = sched.schedule()
    assert out.remote_encoder_inputs == {"r": [0]} and not out.scheduled_encoder_inputs  # not encoded twice
    sched = _sched(speculative_config=EAGLE, max_num_batched_tokens=8, encoder_compute_budget=30,
                   encoder_cache_size=30)  # fmt: skip
    sched.add_request(_req("r", _text(30, 0), [(2, 6, "a"), (8, 12, "b")]))
    sched.encoder.remote_ready = {"a"}
    out = sched.schedule()  # room for both: the boundary item is encoded early
    assert out.remote_encoder_inputs == {"r": [0]} and out.scheduled_encoder_inputs == {"r": [1]}
    sched = _sched(speculative_config=EAGLE, max_num_batched_tokens=8, encoder_compute_budget=30,
                   encoder_cache_size=30)  # fmt: skip
    sched.add_request(_req("r", _text(30, 0), [(2, 6, "a"), (8, 12, "b")]))
    sched.encoder.remote_ready = {"a", "b"}
    out = sched.schedule()  # both published: both loaded, neither encoded here again
    assert out.remote_encoder_inputs == {"r": [0, 1]} and not out.scheduled_encoder_inputs


def test_one_item_cache_never_stalls_on_the_look_ahead():
    """Back-to-back items in a cache that holds one: while the first is
    referenced the second cannot be taken early, so the drafter falls back;
    the request still makes progress every step and finishes."""
    sched = _sched(speculative_config=EAGLE, max_num_batched_tokens=8, encoder_compute_budget=12,
                   encoder_cache_size=12)  # fmt: skip
    worker = DraftingWorker(BS)
    req = _req(
        "a", _text(40, 1), [(4, 12, "x"), (16, 12, "y"), (28, 6, "z")], max_tokens=5
    )
    sched.add_request(req)
    done = run_to_completion(sched, worker)  # asserts progress every step
    assert done["a"].output_token_ids == reference_output(req.prompt_token_ids, 5)
    assert worker.boundary_fallback > 0
    assert sched.encoder_cache_manager.num_referenced_entries == 0
    assert_pool_clean(sched)


def test_random_items_budgets_and_caches_always_finish():
    rng = random.Random(0)
    for trial in range(20):
        size = rng.choice([12, 16, 24, 40])
        sched = _sched(speculative_config=EAGLE, max_num_batched_tokens=rng.choice([5, 8, 13]),
                       encoder_compute_budget=size, encoder_cache_size=size, num_kv_blocks=rng.choice([40, 128]))  # fmt: skip
        worker = DraftingWorker(BS, right=rng.random() < 0.5)
        reqs = []
        for i in range(rng.randint(1, 4)):
            items, off = [], rng.randint(0, 4)
            while off + 4 < 40 and len(items) < 3:
                length = rng.randint(2, min(12, size))
                items.append(
                    (off, length, f"t{trial}-{i}-{len(items)}-{rng.randint(0, 2)}")
                )
                off += length + rng.choice([0, 0, 1, 3])
            reqs.append(
                _req(
                    f"r{i}",
                    _text(44, i + trial),
                    [it for it in items if it[0] + it[1] <= 44],
                    4,
                )
            )
        for r in reqs:
            sched.add_request(r)
        done = run_to_completion(sched, worker)
        for r in reqs:
            assert done[r.request_id].output_token_ids == reference_output(
                r.prompt_token_ids, 4
            )
        assert sched.encoder_cache_manager.num_referenced_entries == 0
        assert_pool_clean(sched)
