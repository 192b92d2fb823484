"""Property tests: OmniTensorPrefixCache against a reference model.

Hypothesis drives random sequences of what the model runner does with the
cache: write a step's rows (with padding slots, padded outputs, a deferred key
skipped), invalidate blocks, merge a batch with a prefix hit, and for deferred
keys stage rows per request, commit when a request finishes (possibly after
it left the batch) or discard on abort. The reference is one dict per cached
key, ``{slot: row written}``, holding only valid rows, plus the staged chunks
of each request as a list; it states the class policy:

- a row read back is exactly the row last written to its slot, and a slot is
  valid from its write until its block is invalidated;
- a hit is served only when every row of its full computed blocks is valid
  (then: the cached rows in block order, then the step's rows), otherwise the
  merge raises naming the request; misses get the step's rows;
- deferred rows are invisible until commit, which writes them into the
  request's allocated blocks only (overlaps: the later start wins) and
  registers the key if needed; a discard or a commit after the request left
  the batch writes nothing.

Invariants after each operation: the registered keys, every key's valid
slots and their contents, and the staged requests equal the reference's.
Hidden rows of width 3 take the per-element copy, width 4 (16 bytes) the wide
one; "foo" is a 3-D float64 output, "codes" the deferred int64 key.
Profiles: tests/conftest.py (HYPOTHESIS_PROFILE=long).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from omnistage.worker.tensor_prefix_cache import HIDDEN_KEY, OmniTensorPrefixCache

TABLE_WIDTH = 4  # block-table entries per batch row
FOO = "foo"  # per-token output written every step
CODES = "codes"  # deferred per-token output: staged, written when its request finishes
TRAILING = {FOO: (2, 3), CODES: (2,)}
DTYPES = {FOO: torch.float64, CODES: torch.long}
DEFERRED_IDS = [f"d{i}" for i in range(3)]  # a small pool: ids are reused after a request ends


class _Group:
    """One KV-cache group of the block table: its CPU rows and allocated counts."""

    def __init__(self, rows: list[list[int]], allocated: list[int]) -> None:
        self.block_table = type("Buf", (), {})()
        self.block_table.cpu = torch.tensor(rows, dtype=torch.int32)
        self.num_blocks_per_row = np.array(allocated, dtype=np.int32)


class FakeBatch:
    """The input-batch surface the cache reads, for the given rows."""

    def __init__(self, req_ids: list[str], tables: list[list[int]], allocated: list[int], computed: list[int]):
        self.req_ids = list(req_ids)
        self.req_id_to_index = {r: i for i, r in enumerate(self.req_ids)}
        self.num_computed_tokens_cpu = np.array(computed, dtype=np.int64)
        rows = [t + [0] * (TABLE_WIDTH - len(t)) for t in tables] or [[0] * TABLE_WIDTH]
        self.block_table = self  # the cache reads block_table.block_tables and block_table[0]
        self.block_tables = [_Group(rows, allocated or [0])]

    def __getitem__(self, idx: int) -> _Group:
        return self.block_tables[idx]


def block_lists(num_blocks: int, max_size: int = TABLE_WIDTH, min_size: int = 0):
    return st.lists(st.integers(0, num_blocks - 1), unique=True, min_size=min_size, max_size=min(max_size, num_blocks))


class TensorPrefixCacheMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(2, 6), block_size=st.integers(1, 3), hidden=st.sampled_from([4, 3]))
    def setup(self, num_blocks: int, block_size: int, hidden: int) -> None:
        self.nb, self.bs, self.num_slots = num_blocks, block_size, num_blocks * block_size
        self.cache = OmniTensorPrefixCache(num_blocks, block_size, hidden, torch.float32)
        self.trailing = {HIDDEN_KEY: (hidden,), **TRAILING}
        self.dtypes = {HIDDEN_KEY: torch.float32, **DTYPES}
        self.rows: dict[str, dict[int, torch.Tensor]] = {HIDDEN_KEY: {}}  # registered key -> valid slot -> row
        self.live: dict[str, dict] = {}  # deferred request -> table, allocated, computed
        self.staged: dict[str, list[tuple[int, torch.Tensor]]] = {}  # deferred request -> chunks, staging order
        self.next_value = 1  # values stay exact in float32 (< 2**24) in any run
        self.prefilled: list[list[int]] = []  # block tables written whole by a prefill

    # -- helpers ---------------------------------------------------------------

    def _fresh(self, key: str, n: int) -> torch.Tensor:
        """``n`` rows for ``key``, every value new, so a row read back names its write."""
        shape = (n, *self.trailing[key])
        start, self.next_value = self.next_value, self.next_value + int(np.prod(shape))
        return torch.arange(start, self.next_value).reshape(shape).to(self.dtypes[key])

    def _register(self, outputs: dict[str, torch.Tensor], seq_len: int) -> None:
        for key, value in outputs.items():
            if key not in self.rows and value.ndim >= 2 and value.shape[0] == seq_len:
                self.rows[key] = {}

    def _expected_merge(self, key: str, blocks: list[int], new: torch.Tensor) -> torch.Tensor | None:
        """The hit's cached rows then ``new``; None when a row is not valid."""
        slots = [b * self.bs + o for b in blocks for o in range(self.bs)]
        if not all(s in self.rows[key] for s in slots):
            return None
        return torch.cat([torch.stack([self.rows[key][s] for s in slots]), new]) if slots else new

    # -- step writes and invalidation ------------------------------------------

    @rule(
        data=st.data(),
        keys=st.sets(st.sampled_from([HIDDEN_KEY, FOO, CODES]), min_size=1),
        skip_codes=st.booleans(),
        extra_rows=st.integers(0, 2),
    )
    def write_step(self, data, keys: set[str], skip_codes: bool, extra_rows: int) -> None:
        """One step's rows to their slots; -1 is padding, rows past n are padding too."""
        slots = data.draw(st.lists(st.integers(0, self.num_slots - 1), unique=True, max_size=6), label="slots")
        pads = data.draw(st.lists(st.integers(0, len(slots)), max_size=2), label="padding at")
        for i in sorted(pads, reverse=True):
            slots.insert(i, -1)
        n = len(slots)
        padded = n + extra_rows if extra_rows else None
        seq_len = padded or n
        hidden = self._fresh(HIDDEN_KEY, seq_len) if HIDDEN_KEY in keys else None
        outputs = {k: self._fresh(k, seq_len) for k in keys - {HIDDEN_KEY}}
        skip = {CODES} if skip_codes else None
        self.cache.update_omni_tensor_prefix_cache(hidden, outputs, n, torch.tensor(slots, dtype=torch.long),
                                                   num_tokens_padded=padded, skip_mm_cache_keys=skip)
        self._register(outputs, seq_len)
        sources = {HIDDEN_KEY: hidden, **outputs}
        for key, value in sources.items():
            if value is None or key not in self.rows or (skip and key in skip):
                continue
            for i, slot in enumerate(slots):
                if slot != -1:
                    self.rows[key][slot] = value[i]

    @rule(data=st.data(), keys=st.sets(st.sampled_from([FOO, CODES])), fresh=st.booleans())
    def prefill(self, data, keys: set[str], fresh: bool) -> None:
        """A request's prefill: its new blocks invalidated (when fresh), then every slot written in order."""
        table = data.draw(block_lists(self.nb, 3, min_size=1), label="table")
        if fresh:
            self.cache.invalidate_blocks(table)
            self._drop_blocks(table)
        slots = [b * self.bs + o for b in table for o in range(self.bs)]
        hidden = self._fresh(HIDDEN_KEY, len(slots))
        outputs = {k: self._fresh(k, len(slots)) for k in keys}
        self.cache.update_omni_tensor_prefix_cache(hidden, outputs, len(slots), torch.tensor(slots))
        self._register(outputs, len(slots))
        for key, value in {HIDDEN_KEY: hidden, **outputs}.items():
            self.rows[key].update(zip(slots, value))
        self.prefilled.append(table)

    def _drop_blocks(self, blocks: list[int]) -> None:
        for rows in self.rows.values():
            for slot in [s for s in rows if s // self.bs in blocks]:
                del rows[slot]

    @rule(data=st.data())
    def invalidate(self, data) -> None:
        blocks = data.draw(st.lists(st.integers(0, self.nb - 1), max_size=3), label="blocks")
        self.cache.invalidate_blocks(blocks)
        self._drop_blocks(blocks)

    # -- merges ------------------------------------------------------------------

    @rule(
        data=st.data(),
        partial=st.integers(0, 2),
        num_new=st.tuples(st.integers(1, 3), st.integers(0, 3)),
        hit_first=st.booleans(),
        packed_in_order=st.booleans(),
        passthrough=st.booleans(),
    )
    def merge(self, data, partial: int, num_new: tuple[int, int], hit_first: bool, packed_in_order: bool,
              passthrough: bool) -> None:
        """A batch of a hit request and a miss: hidden states and multimodal outputs."""
        # Mostly the table of an earlier prefill (a prefix of it), sometimes any blocks.
        tables = st.sampled_from(self.prefilled) | block_lists(self.nb) if self.prefilled else block_lists(self.nb)
        table = data.draw(tables, label="hit table")
        num_full = data.draw(st.integers(0, len(table)), label="full computed blocks")
        computed = num_full * self.bs + (min(partial, self.bs - 1) if num_full < len(table) else 0)
        miss_table = data.draw(block_lists(self.nb), label="miss table")
        order = ["hit", "miss"] if hit_first else ["miss", "hit"]
        info = {"hit": (table, computed, num_new[0]), "miss": (miss_table, 0, num_new[1])}
        batch = FakeBatch(order, [info[r][0] for r in order], [len(info[r][0]) for r in order],
                          [info[r][1] for r in order])
        lengths = {r: info[r][2] for r in order}
        spans_order = order if packed_in_order else order[::-1]  # qsl need not follow batch order
        starts = dict(zip(spans_order, itertools.accumulate([lengths[r] for r in spans_order], initial=0)))
        qsl = [starts[r] for r in order]
        total = sum(lengths.values())
        self.cache.add_prefix_cached_new_req_id("hit")
        self.cache.add_prefix_cached_new_req_id("gone")  # hit ids not in the batch are ignored

        def expect(key: str, value: torch.Tensor) -> dict[str, torch.Tensor] | None:
            new = {r: value[starts[r]: starts[r] + lengths[r]] for r in order}
            merged = self._expected_merge(key, table[:num_full], new["hit"])
            return None if merged is None else {"hit": merged, "miss": new["miss"]}

        hidden = self._fresh(HIDDEN_KEY, total)
        want = expect(HIDDEN_KEY, hidden)
        if want is None:
            event("hit refused: rows not valid")
            with pytest.raises(RuntimeError, match=r"'hit'.*'hidden_states'"):
                self.cache.get_merged_hidden_states(qsl, batch, hidden, lengths)
        else:
            event("hit served" if num_full else "hit of no full block")
            got = self.cache.get_merged_hidden_states(qsl, batch, hidden, lengths)
            assert set(got) == {"hit", "miss"}
            for r in order:
                assert torch.equal(got[r], want[r]), f"{r}: merged hidden rows differ from the reference"

        outputs = {k: self._fresh(k, total) for k in (FOO, CODES)}
        if passthrough:
            outputs["meta"] = torch.arange(total)  # 1-D, token aligned: split, never cached
        wants = {k: expect(k, v) for k, v in outputs.items() if k in self.rows}
        if any(w is None for w in wants.values()):
            with pytest.raises(RuntimeError, match=r"'hit'"):
                self.cache.get_merged_multimodal_states(qsl, batch, outputs, lengths)
        else:
            got = self.cache.get_merged_multimodal_states(qsl, batch, outputs, lengths)
            assert set(got) == set(outputs)
            for key, value in outputs.items():
                want = wants.get(key) or {r: value[starts[r]: starts[r] + lengths[r]] for r in order}  # passthrough
                for r in order:
                    assert torch.equal(got[key][r], want[r]), f"{key!r} of {r}: merged rows differ"
        self.cache.reset_prefix_cached_new_req_ids()

    # -- deferred rows -------------------------------------------------------------

    def _add_deferred_request(self, data, unallocated: int) -> None:
        """A request whose block table row may hold entries past its allocated blocks."""
        rid = data.draw(st.sampled_from([r for r in DEFERRED_IDS if r not in self.live]), label="request id")
        table = data.draw(block_lists(self.nb), label="table")
        self.live[rid] = {"table": table, "allocated": max(0, len(table) - unallocated), "computed": 0}

    def _batch(self, rids: list[str]) -> FakeBatch:
        live = [self.live[r] for r in rids]
        return FakeBatch(rids, [r["table"] for r in live], [r["allocated"] for r in live],
                         [r["computed"] for r in live])

    @rule(data=st.data(), new_request=st.booleans(), unallocated=st.integers(0, 2),
          num_steps=st.integers(0, 2).map(lambda n: (n + 1) % 3 + 1))
    def stage(self, data, new_request: bool, unallocated: int, num_steps: int) -> None:
        """Steps, maybe with a new request first: each live request computes 0..3 tokens
        and stages its rows of the deferred key. A request may first step back (its
        last tokens recomputed), so its new chunk overlaps staged ones."""
        if (new_request or not self.live) and len(self.live) < len(DEFERRED_IDS):
            self._add_deferred_request(data, unallocated)
        rids = sorted(self.live)
        # back shrinks to 1: the simplest examples overlap too.
        steps = st.tuples(st.integers(0, 3), st.integers(0, 2).map(lambda b: (b + 1) % 3))
        for _ in range(num_steps):
            drawn = data.draw(st.lists(steps, min_size=len(rids), max_size=len(rids)), label="(tokens, back)")
            counts = [n for n, _ in drawn]
            for rid, (n, back) in zip(rids, drawn):
                req = self.live[rid]
                req["computed"] = max(0, req["computed"] - back) + n  # already counts this step's tokens
            sched = dict(zip(rids, counts))
            qsl = list(itertools.accumulate(counts[:-1], initial=0))
            codes = self._fresh(CODES, sum(counts))
            outputs = {CODES: codes, FOO: self._fresh(FOO, sum(counts))}  # only deferred keys are staged
            self.cache.stage_deferred_mm_outputs(qsl, self._batch(rids), outputs, sched, {CODES})
            for rid, start, n in zip(rids, qsl, counts):
                if n:
                    self.staged.setdefault(rid, []).append((self.live[rid]["computed"] - n, codes[start: start + n]))

    @rule(data=st.data())
    def finish(self, data) -> None:
        """Some requests end, each in one of three ways: it finishes in the batch (its
        staged rows are written), finishes after it left the batch, or is aborted
        (discarded; the commit that still names it writes nothing)."""
        if not self.live:
            return
        rids = sorted(self.live)
        done = data.draw(st.lists(st.sampled_from(rids), unique=True, min_size=1, max_size=2), label="ended")
        how = {r: data.draw(st.sampled_from(["commit", "left", "abort"]), label=f"how {r} ended") for r in done}
        for rid in done:
            if how[rid] == "abort":
                self.cache.discard_deferred_mm_outputs(rid)
        in_batch = [r for r in rids if how.get(r) != "left"]
        self.cache.commit_deferred_mm_outputs(done, self._batch(in_batch))
        for rid in done:
            req, chunks = self.live.pop(rid), self.staged.pop(rid, [])
            if how[rid] != "commit" or not chunks:
                if chunks:
                    event(f"staged rows dropped ({how[rid]})")
                continue
            spans = [(s, s + len(r)) for s, r in chunks]
            if any(a < d and c < b for (a, b), (c, d) in itertools.combinations(spans, 2)):
                event("overlapping chunks committed")
            rows_by_pos: dict[int, torch.Tensor] = {}
            for start, rows in sorted(chunks, key=lambda c: c[0]):  # stable: later start, then later staged, wins
                for i, row in enumerate(rows):
                    rows_by_pos[start + i] = row
            if CODES not in self.rows:
                self.rows[CODES] = {}
            for pos, row in rows_by_pos.items():
                if pos // self.bs < req["allocated"]:  # only into blocks allocated to the request
                    self.rows[CODES][req["table"][pos // self.bs] * self.bs + pos % self.bs] = row
            event("deferred rows committed")

    # -- invariants ------------------------------------------------------------

    @invariant()
    def rows_match_reference(self) -> None:
        cache = self.cache
        assert cache.mm_cache_keys == set(self.rows) - {HIDDEN_KEY}
        assert set(cache.mm_outputs_cache) == cache.mm_cache_keys
        for key, rows in self.rows.items():
            tensors = cache._hidden if key == HIDDEN_KEY else cache._mm[key]
            valid = torch.zeros(self.num_slots, dtype=torch.bool)
            valid[list(rows)] = True
            assert torch.equal(tensors.valid.view(-1), valid), f"{key!r}: valid slots differ from the reference"
            if rows:
                data = (cache.hidden_states_cache if key == HIDDEN_KEY else cache.mm_outputs_cache[key])
                slots = sorted(rows)
                flat = data.view(self.num_slots, *self.trailing[key])
                assert torch.equal(flat[slots], torch.stack([rows[s] for s in slots])), f"{key!r}: rows differ"

    @invariant()
    def staged_match_reference(self) -> None:
        staged = self.cache._deferred_mm_outputs
        assert set(staged) == {r for r, chunks in self.staged.items() if chunks}
        for rid, chunks in self.staged.items():
            got = staged[rid][CODES]
            assert [s for s, _ in got] == [s for s, _ in chunks]
            assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, chunks))


TestTensorPrefixCacheProperties = TensorPrefixCacheMachine.TestCase
