"""EncoderCacheManager: sharing, reference counts, oldest-first eviction,
freed-id draining, and the encoder budgets."""

from __future__ import annotations

import random

import pytest
import torch

from omnistage.core.encoder_cache_manager import EncoderCacheManager, compute_mm_encoder_budget
from omnistage.core.request import Request
from omnistage.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from omnistage.sampling_params import SamplingParams


def make_request(
    request_id: str, items: list[tuple[str, int]], is_embed: list[list[bool] | None] | None = None
) -> Request:
    """A request whose items are ``(identifier, num_placeholder_tokens)``,
    laid out back to back with one text token between them."""
    features = []
    offset = 1
    for k, (identifier, length) in enumerate(items):
        mask = None
        if is_embed is not None and is_embed[k] is not None:
            mask = torch.tensor(is_embed[k], dtype=torch.bool)
        features.append(
            MultiModalFeatureSpec(
                data=None,
                modality="image",
                identifier=identifier,
                mm_position=PlaceholderRange(offset=offset, length=length, is_embed=mask),
            )
        )
        offset += length + 1
    return Request(request_id, [0] * offset, SamplingParams(), mm_features=features)


def check_invariants(m: EncoderCacheManager) -> None:
    assert 0 <= m.num_free_slots <= m.num_freeable_slots <= m.cache_size
    assert m.num_freeable_slots - m.num_free_slots == sum(m.freeable.values())
    assert m.cache_size - m.num_free_slots == sum(m.entry_size.values())
    assert set(m.freeable) == {h for h, users in m.cached.items() if not users}


def test_allocate_and_hit_shared_across_requests():
    m = EncoderCacheManager(cache_size=10)
    a = make_request("a", [("img1", 4)])
    b = make_request("b", [("img1", 4)])
    assert not m.check_and_update_cache(a, 0)
    assert m.can_allocate(a, 0, encoder_compute_budget=10, num_embeds_to_schedule=0)
    m.allocate(a, 0)
    assert m.num_free_slots == 6 and m.num_freeable_slots == 6
    # a second request with equal content shares the entry: no new space
    assert m.check_and_update_cache(b, 0)
    assert m.cached["img1"] == {"a", "b"}
    assert m.num_free_slots == 6
    m.free(a)
    assert m.cached["img1"] == {"b"} and not m.freeable
    m.free(b)
    assert m.freeable == {"img1": 4}
    assert m.num_free_slots == 6 and m.num_freeable_slots == 10
    check_invariants(m)


def test_counts_embeddings_not_placeholder_tokens():
    m = EncoderCacheManager(cache_size=3)
    # 5 placeholder tokens, 3 of which receive embeddings
    r = make_request("r", [("x", 5)], is_embed=[[False, True, False, True, True]])
    assert m.can_allocate(r, 0, 3, 0)
    m.allocate(r, 0)
    assert m.num_free_slots == 0
    check_invariants(m)


def test_freeable_entry_is_revived_by_a_hit_and_not_evicted():
    m = EncoderCacheManager(cache_size=8)
    a = make_request("a", [("x", 4)])
    m.allocate(a, 0)
    m.free(a)
    assert "x" in m.freeable
    b = make_request("b", [("x", 4)])
    assert m.check_and_update_cache(b, 0)
    assert "x" not in m.freeable and m.num_freeable_slots == 4
    # needing more than the free space must not evict a referenced entry
    c = make_request("c", [("y", 5)])
    assert not m.can_allocate(c, 0, 100, 0)
    assert m.get_freed_mm_hashes() == []
    check_invariants(m)


def test_eviction_is_lazy_and_oldest_released_first():
    m = EncoderCacheManager(cache_size=6)
    reqs = {h: make_request(f"r{h}", [(h, 2)]) for h in "abc"}
    for h in "abc":
        m.allocate(reqs[h], 0)
    # release in the order b, a, c
    for h in "bac":
        m.free(reqs[h])
    assert list(m.freeable) == ["b", "a", "c"]
    assert m.get_freed_mm_hashes() == []  # nothing is evicted until space is needed
    new = make_request("new", [("d", 3)])
    assert m.can_allocate(new, 0, 10, 0)
    # 3 rows needed with 0 free: the two oldest released entries go
    assert m.get_freed_mm_hashes() == ["b", "a"]
    assert "c" in m.cached and "b" not in m.cached and "a" not in m.cached
    m.allocate(new, 0)
    assert m.num_free_slots == 1
    check_invariants(m)


def test_can_allocate_budgets():
    m = EncoderCacheManager(cache_size=10)
    r = make_request("r", [("x", 4), ("y", 4), ("z", 4)])
    assert not m.can_allocate(r, 0, encoder_compute_budget=3, num_embeds_to_schedule=0)
    assert m.can_allocate(r, 0, 4, 0)
    # items already chosen for this request in this pass count against space
    assert m.can_allocate(r, 1, 8, num_embeds_to_schedule=4)
    assert not m.can_allocate(r, 2, 8, num_embeds_to_schedule=8)
    check_invariants(m)


def test_cannot_evict_more_than_freeable():
    m = EncoderCacheManager(cache_size=6)
    a = make_request("a", [("x", 3), ("y", 3)])
    m.allocate(a, 0)
    m.allocate(a, 1)
    m.free_encoder_input(a, 0)  # x freeable, y referenced
    b = make_request("b", [("z", 4)])
    assert not m.can_allocate(b, 0, 10, 0)  # 4 > 3 reclaimable
    assert m.get_freed_mm_hashes() == [] and "x" in m.cached  # nothing was evicted
    c = make_request("c", [("w", 3)])
    assert m.can_allocate(c, 0, 10, 0)
    assert m.get_freed_mm_hashes() == ["x"]
    check_invariants(m)


def test_freed_ids_filter_same_pass_reallocation():
    m = EncoderCacheManager(cache_size=4)
    a = make_request("a", [("x", 4)])
    m.allocate(a, 0)
    m.free(a)
    # a pass: "y" evicts "x", then a later request brings "x" back
    b = make_request("b", [("y", 2)])
    assert m.can_allocate(b, 0, 10, 0)
    m.allocate(b, 0)
    m.free(b)
    c = make_request("c", [("x", 4)])
    assert not m.check_and_update_cache(c, 0)
    assert m.can_allocate(c, 0, 10, 0)  # evicts "y"
    m.allocate(c, 0)
    # "x" is cached again: the worker must not drop the fresh output
    assert m.get_freed_mm_hashes() == ["y"]
    assert m.get_freed_mm_hashes() == []  # drained
    check_invariants(m)


def test_repeated_item_in_one_request_holds_until_last_input_freed():
    m = EncoderCacheManager(cache_size=8)
    # the same image in two turns of one conversation
    r = make_request("r", [("img", 4), ("other", 2), ("img", 4)])
    m.allocate(r, 0)
    assert m.check_and_update_cache(r, 2)
    assert m.cached["img"] == {"r"}
    m.free_encoder_input(r, 0)  # first turn's copy is behind the window
    assert m.cached["img"] == {"r"} and "img" not in m.freeable
    assert m.get_cached_input_ids(r) == {2}
    m.free_encoder_input(r, 2)
    assert "img" in m.freeable
    m.free_encoder_input(r, 2)  # idempotent
    assert m.num_freeable_slots == 8
    check_invariants(m)


def test_free_request_and_reset():
    m = EncoderCacheManager(cache_size=10)
    a = make_request("a", [("x", 2), ("y", 3)])
    m.allocate(a, 0)
    m.allocate(a, 1)
    assert m.get_cached_input_ids(a) == {0, 1}
    m.free(a)
    assert m.get_cached_input_ids(a) == set()
    assert m.num_freeable_slots == 10 and m.num_free_slots == 5
    m.reset()
    assert len(m) == 0 and m.num_free_slots == 10 and m.num_freeable_slots == 10
    assert m.get_freed_mm_hashes() == []


def test_errors_are_clear():
    m = EncoderCacheManager(cache_size=4)
    r = make_request("r", [("x", 3), ("y", 3)])
    with pytest.raises(ValueError, match="out of range"):
        m.check_and_update_cache(r, 5)
    m.allocate(r, 0)
    with pytest.raises(ValueError, match="already cached"):
        m.allocate(r, 0)
    with pytest.raises(ValueError, match="only 1 are free"):
        m.allocate(r, 1)
    with pytest.raises(ValueError, match="cache_size"):
        EncoderCacheManager(-1)


def test_item_fits():
    m = EncoderCacheManager(cache_size=100)
    assert m.item_fits(100)
    assert not m.item_fits(101)
    assert not m.item_fits(60, compute_budget=50)


def test_random_operations_keep_invariants_and_all_free_at_end():
    rng = random.Random(0)
    m = EncoderCacheManager(cache_size=20)
    identifiers = [f"h{i}" for i in range(8)]
    sizes = {h: rng.randint(1, 6) for h in identifiers}
    live: list[Request] = []
    worker: set[str] = set()  # what a worker mirroring the frees would hold
    for step in range(400):
        if live and rng.random() < 0.3:
            req = live.pop(rng.randrange(len(live)))
            m.free(req)
        else:
            items = [(h, sizes[h]) for h in rng.sample(identifiers, rng.randint(1, 3))]
            req = make_request(f"r{step}", items)
            scheduled = 0
            ok = True
            for i in range(len(items)):
                if m.check_and_update_cache(req, i):
                    assert items[i][0] in worker
                    continue
                if m.can_allocate(req, i, encoder_compute_budget=20, num_embeds_to_schedule=scheduled):
                    m.allocate(req, i)
                    scheduled += items[i][1]
                    worker.add(items[i][0])
                else:
                    ok = False
                    break
            live.append(req)
            if not ok:
                m.free(live.pop())
        worker -= set(m.get_freed_mm_hashes())
        check_invariants(m)
        assert set(m.cached) <= worker
    for req in live:
        m.free(req)
    assert all(not users for users in m.cached.values())
    assert m.num_freeable_slots == m.cache_size


def test_compute_mm_encoder_budget():
    # defaults: the step's token budget, for both
    assert compute_mm_encoder_budget(2048, {"image": 1280, "audio": 750}) == (2048, 2048)
    # an item larger than the step's token budget is still schedulable
    assert compute_mm_encoder_budget(512, {"image": 1280}) == (1280, 1280)
    assert compute_mm_encoder_budget(512, 100, max_num_batched_encoder_embeds=64) == (100, 100)
    assert compute_mm_encoder_budget(512, 100, encoder_cache_size=4096) == (512, 4096)
    assert compute_mm_encoder_budget(512, {}) == (0, 0)  # text-only
    with pytest.raises(ValueError):
        compute_mm_encoder_budget(512, {"image": -1})


def test_invalidate_forgets_entries_the_worker_does_not_hold():
    """An entry whose output never reached the worker (its encoder run failed) is forgotten,
    referenced or not: its rows are free, its holders lose the hold (their next window plans
    the item again) and nothing is reported freed (the worker holds nothing to drop)."""
    m = EncoderCacheManager(cache_size=12)
    a, b = make_request("a", [("img1", 4), ("img2", 4)]), make_request("b", [("img1", 4)])
    m.allocate(a, 0)
    m.allocate(a, 1)
    assert m.check_and_update_cache(b, 0)
    m.free_encoder_input(a, 1)  # img2 freeable
    m.invalidate(["img1", "img2", "never-cached"])
    check_invariants(m)
    assert not m.cached and m.num_free_slots == 12 and not m.get_freed_mm_hashes()
    assert m.get_cached_input_ids(a) == set() and m.get_cached_input_ids(b) == set() and not m._holders
    assert not m.check_and_update_cache(b, 0)  # no hit on nothing: b's item is encoded again
    m.free(a)
    m.free(b)
    check_invariants(m)
