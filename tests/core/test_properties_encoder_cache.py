"""Property tests: EncoderCacheManager against a reference model.

Hypothesis drives random sequences of what the encoder scheduler does with
the manager: look up an item (a hit takes a reference), plan several items of
one request for a step (``can_allocate`` with the rows already chosen, which
may evict, then ``allocate`` each), release one item or a whole request, end a
step (the worker drops what ``get_freed_mm_hashes`` names) and reset. The
reference is plain dicts and lists stating the class policy:

- entries keyed by identifier, each request holding at most one reference
  per identifier until the last of its items carrying it is released;
- unreferenced entries kept and evicted oldest-released first, only when
  space is needed (at once with ``retain_unreferenced=False``);
- the rows of all entries within ``cache_size``;
- an identifier evicted and allocated again before the step ends is not
  reported as freed.

A mirror of the worker's store (encoded on allocate, dropped on the freed
list) checks what a hit is for: every entry the manager calls cached is one
the worker holds. Profiles: tests/conftest.py (HYPOTHESIS_PROFILE=long).
"""

from __future__ import annotations

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from omnistage.core.encoder_cache_manager import EncoderCacheManager
from omnistage.core.request import Request
from omnistage.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from omnistage.sampling_params import SamplingParams

IDENTIFIERS = [f"img{i}" for i in range(4)]
REQUEST_IDS = [f"r{i}" for i in range(5)]  # a small pool: ids are reused after free
# Rules drawn uniformly would reset every few steps and wipe the state worth testing:
# a reset runs on one draw in ten (and not in the simplest examples).
RARELY = st.integers(0, 9).map(lambda n: n == 9)


def make_request(request_id: str, items: list[tuple[str, int]]) -> Request:
    """A request whose items are ``(identifier, num_embeds)``, one text token apart."""
    features, offset = [], 1
    for identifier, length in items:
        span = PlaceholderRange(offset=offset, length=length)
        features.append(MultiModalFeatureSpec(data=None, modality="image", identifier=identifier, mm_position=span))
        offset += length + 1
    return Request(request_id, [0] * offset, SamplingParams(), mm_features=features)


class RefEncoderCache:
    """What the manager must hold, in plain Python."""

    def __init__(self, cache_size: int, retain: bool) -> None:
        self.cache_size, self.retain = cache_size, retain
        self.size: dict[str, int] = {}  # identifier -> rows, for every entry
        self.holders: dict[str, dict[str, set[int]]] = {}  # request -> identifier -> its input ids
        self.freeable: list[str] = []  # unreferenced entries, oldest released first
        self.freed: list[str] = []  # evicted since the last drain

    def users(self, identifier: str) -> set[str]:
        return {r for r, held in self.holders.items() if identifier in held}

    @property
    def num_free(self) -> int:
        return self.cache_size - sum(self.size.values())

    def hit(self, rid: str, identifier: str, input_id: int) -> bool:
        if identifier not in self.size:
            return False
        if identifier in self.freeable:
            self.freeable.remove(identifier)
        self.holders.setdefault(rid, {}).setdefault(identifier, set()).add(input_id)
        return True

    def can_allocate(self, num_embeds: int, budget: int, scheduled: int) -> bool:
        if num_embeds > budget:
            return False
        needed = num_embeds + scheduled
        if needed > self.num_free + sum(self.size[h] for h in self.freeable):
            return False
        while self.num_free < needed:  # oldest released first, only as far as needed
            self._evict(self.freeable.pop(0))
        return True

    def allocate(self, rid: str, identifier: str, num_embeds: int, input_id: int) -> None:
        assert identifier not in self.size and num_embeds <= self.num_free
        self.size[identifier] = num_embeds
        self.holders.setdefault(rid, {}).setdefault(identifier, set()).add(input_id)

    def release(self, rid: str, identifier: str, input_id: int) -> None:
        inputs = self.holders.get(rid, {}).get(identifier)
        if not inputs or input_id not in inputs:
            return
        inputs.discard(input_id)
        if inputs:
            return
        del self.holders[rid][identifier]
        if not self.holders[rid]:
            del self.holders[rid]
        if not self.users(identifier):
            if self.retain:
                self.freeable.append(identifier)
            else:
                self._evict(identifier)

    def drain(self) -> list[str]:
        out = list(dict.fromkeys(h for h in self.freed if h not in self.size))
        self.freed = []
        return out

    def _evict(self, identifier: str) -> None:
        assert not self.users(identifier), f"{identifier} evicted while referenced"
        del self.size[identifier]
        self.freed.append(identifier)


class EncoderCacheMachine(RuleBasedStateMachine):
    @initialize(
        cache_size=st.integers(0, 12).map(lambda n: 12 - n),
        retain=st.booleans().map(lambda off: not off),
        sizes=st.lists(st.integers(1, 5), min_size=len(IDENTIFIERS), max_size=len(IDENTIFIERS)),
    )
    def setup(self, cache_size: int, retain: bool, sizes: list[int]) -> None:
        self.m = EncoderCacheManager(cache_size, retain_unreferenced=retain)
        self.ref = RefEncoderCache(cache_size, retain)
        self.sizes = dict(zip(IDENTIFIERS, sizes))  # an identifier is a content hash: one size each
        self.live: dict[str, Request] = {}
        self.worker: set[str] = set()  # identifiers whose encoder output the worker holds

    # -- helpers ---------------------------------------------------------------

    def _items(self, rid: str) -> list[tuple[str, int]]:
        return [(f.identifier, f.mm_position.get_num_embeds()) for f in self.live[rid].mm_features]

    def _hit(self, rid: str, k: int) -> bool:
        identifier = self._items(rid)[k][0]
        got = self.m.check_and_update_cache(self.live[rid], k)
        assert got == self.ref.hit(rid, identifier, k)
        if got:  # a hit means the worker holds (or will encode this step) the output
            assert identifier in self.worker
        return got

    # -- rules -----------------------------------------------------------------

    @rule(
        data=st.data(),
        new_items=st.lists(st.sampled_from(IDENTIFIERS), max_size=4),
        budget=st.integers(0, 12).map(lambda n: 12 - n),
    )
    def step(self, data, new_items: list[str], budget: int) -> None:
        """One scheduling pass: maybe a new request (its items possibly the same
        image twice), encoder plans for some running requests under the step's
        budget, then the worker drops what the manager reports freed."""
        free_ids = [r for r in REQUEST_IDS if r not in self.live]
        if new_items and free_ids:
            rid = data.draw(st.sampled_from(free_ids), label="new request id")
            self.live[rid] = make_request(rid, [(h, self.sizes[h]) for h in new_items])
        if self.live:
            rids = data.draw(st.lists(st.sampled_from(sorted(self.live)), unique=True), label="scheduled")
            for rid in rids:
                budget -= self._plan_and_commit(rid, budget)
        self._end_step()

    def _plan_and_commit(self, rid: str, budget: int) -> int:
        """One request's items, as the encoder scheduler plans them: hits pin, the
        rest is checked with the rows already chosen, then allocated together.
        Returns the rows encoded."""
        items, req = self._items(rid), self.live[rid]
        held = self.m.get_cached_input_ids(req)
        chosen: dict[str, int] = {}  # identifier -> first input id to encode
        same_content: list[int] = []
        scheduled = 0
        for k, (identifier, n) in enumerate(items):
            if k in held:
                continue
            if identifier in chosen:
                same_content.append(k)
                continue
            if self._hit(rid, k):
                event("hit")
                continue
            want = self.ref.can_allocate(n, budget - scheduled, scheduled)
            assert self.m.can_allocate(req, k, budget - scheduled, scheduled) == want
            if not want:
                event("cannot allocate")
                break
            chosen[identifier] = k
            scheduled += n
        for identifier, k in chosen.items():  # can_allocate promised room for all of them
            self.m.allocate(req, k)
            self.ref.allocate(rid, identifier, items[k][1], k)
            self.worker.add(identifier)  # encoded this step
        for k in same_content:
            assert self._hit(rid, k)
        return scheduled

    @rule(data=st.data())
    def release_item(self, data) -> None:
        """An item's span is computed: its hold goes (a no-op if it holds nothing)."""
        if not self.live:
            return
        rid = data.draw(st.sampled_from(sorted(self.live)), label="request")
        k = data.draw(st.integers(0, len(self.live[rid].mm_features) - 1), label="item")
        self.m.free_encoder_input(self.live[rid], k)
        self.ref.release(rid, self._items(rid)[k][0], k)

    @rule(data=st.data())
    def free_request(self, data) -> None:
        """Finish, abort or preempt."""
        if not self.live:
            return
        rid = data.draw(st.sampled_from(sorted(self.live)), label="request")
        req = self.live.pop(rid)
        self.m.free(req)
        for k in sorted({k for inputs in self.ref.holders.get(rid, {}).values() for k in inputs}):
            self.ref.release(rid, req.mm_features[k].identifier, k)

    def _end_step(self) -> None:
        if any(h in self.ref.size for h in self.ref.freed):
            event("evicted and allocated again in one pass")
        freed = self.m.get_freed_mm_hashes()
        assert freed == self.ref.drain()
        if freed:
            event("entries freed")
        for identifier in freed:  # never drop what the manager still calls cached
            assert identifier not in self.m
        self.worker -= set(freed)

    @rule(now=RARELY)
    def reset(self, now: bool) -> None:
        if not now:
            return
        self.m.reset()
        self.live.clear()  # after a weight update every request starts over
        self.ref = RefEncoderCache(self.ref.cache_size, self.ref.retain)
        self.worker.clear()

    # -- invariants ------------------------------------------------------------

    @invariant()
    def matches_reference(self) -> None:
        m, ref = self.m, self.ref
        assert 0 <= m.num_free_slots <= m.num_freeable_slots <= m.cache_size
        assert m.entry_size == ref.size
        assert sum(m.entry_size.values()) <= m.cache_size
        assert m.num_free_slots == ref.num_free
        assert m.num_freeable_slots == ref.num_free + sum(ref.size[h] for h in ref.freeable)
        assert list(m.freeable) == ref.freeable  # eviction order: oldest released first
        assert {h: users for h, users in m.cached.items()} == {h: ref.users(h) for h in ref.size}
        assert m.num_referenced_entries == sum(1 for h in ref.size if ref.users(h))
        for rid, req in self.live.items():
            assert m.get_cached_input_ids(req) == {k for ks in ref.holders.get(rid, {}).values() for k in ks}
        if not ref.retain:
            assert not m.freeable  # nothing outlives its last user
        assert set(m.cached) <= self.worker  # every entry is held by the worker

    def teardown(self) -> None:
        if not hasattr(self, "m"):
            return
        for req in self.live.values():
            self.m.free(req)
        assert self.m.num_referenced_entries == 0 and self.m.num_freeable_slots == self.m.cache_size


TestEncoderCacheProperties = EncoderCacheMachine.TestCase
