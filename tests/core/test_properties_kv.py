"""Property tests: BlockPool and KVCacheManager against a reference model.

Hypothesis drives random sequences of operations (admit with a prefix hit,
schedule more tokens, run a step, decode, free, reset, and on the bare pool
allocate / touch / register / free) and after each one the real objects must
agree with a model made of plain lists and dicts that states the policies of
the docstrings:

- a free block list in two queues (plain ones FIFO, cached ones in
  least-recently-freed order), so the model names the exact block ids each
  allocation returns, which is the LRU eviction order;
- the prefix index as ``{token prefix: block id}``, so the model names the
  exact blocks of each hit, and an evicted block's key stops hitting;
- reference counts per block and the block table of each request.

Independently of the model, a fake KV store (each slot holds the token prefix
it was computed from, as in ``core_sim``) checks what a hit is for: every
registered block, and every block a request reads, holds exactly the KV of
its prefix. Profiles: tests/conftest.py (HYPOTHESIS_PROFILE=long for a longer run).
"""

from __future__ import annotations

import pytest
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from omnistage.core.block_pool import BlockPool
from omnistage.core.kv_cache_manager import KVCacheManager
from omnistage.core.kv_cache_utils import BlockHash, cdiv, hash_block_tokens, update_block_hashes
from omnistage.core.request import Request
from omnistage.sampling_params import SamplingParams

# Prompts are a prefix of a shared base plus a tail over a tiny alphabet, so
# hits, misses after a differing block, and equal prefixes computed twice
# (the "first writer wins" case) all come up often.
BASE = list(range(100, 112))
TAIL_TOKENS = st.integers(0, 2)
REQUEST_IDS = [f"r{i}" for i in range(6)]  # a small pool: ids are reused after free
# Rules drawn uniformly would reset every few steps and wipe the state worth testing:
# a reset runs on one draw in ten (and not in the simplest examples).
RARELY = st.integers(0, 9).map(lambda n: n == 9)


class RefKV:
    """What the KV cache manager must hold, in plain Python."""

    def __init__(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.num_blocks, self.bs, self.caching = num_blocks, block_size, caching
        self.refs = [0] * num_blocks
        self.free_plain: list[int] = list(range(num_blocks))  # no key: FIFO
        self.free_cached: list[int] = []  # has a key: least recently freed first
        self.index: dict[tuple[int, ...], int] = {}  # full-block token prefix -> block
        self.key_of: dict[int, tuple[int, ...]] = {}
        self.tables: dict[str, list[int]] = {}
        self.registered: dict[str, int] = {}  # leading blocks of the request registered
        self.stats = [0, 0, 0]  # queries, query tokens, hit tokens
        self.evicted: list[tuple[int, ...]] = []  # keys dropped by the last allocation

    @property
    def num_free(self) -> int:
        return len(self.free_plain) + len(self.free_cached)

    def hit(self, tokens: list[int]) -> list[int]:
        """Longest run of cached full blocks from the start, leaving the last token."""
        if not self.caching:
            return []
        out = []
        for i in range((len(tokens) - 1) // self.bs):
            block = self.index.get(tuple(tokens[: (i + 1) * self.bs]))
            if block is None:
                break
            out.append(block)
        return out

    def allocate(self, req_id: str, total_tokens: int, hit: list[int], num_tokens: int) -> list[int] | None:
        held = self.tables.get(req_id)
        num_new = max(0, cdiv(total_tokens, self.bs) - (len(held) if held else 0) - len(hit))
        revived = [b for b in hit if self.refs[b] == 0]
        self.evicted = []
        if num_new + len(revived) > self.num_free:
            return None
        for b in hit:
            if self.refs[b] == 0:
                self.free_cached.remove(b)
            self.refs[b] += 1
        new = []
        for _ in range(num_new):
            if self.free_plain:
                b = self.free_plain.pop(0)
            else:
                b = self.free_cached.pop(0)
                self.evicted.append(self.key_of.pop(b))
                del self.index[self.evicted[-1]]
            self.refs[b] = 1
            new.append(b)
        if held is None:
            self.tables[req_id] = hit + new
            self.registered[req_id] = len(hit)
            self.stats[0] += 1
            self.stats[1] += num_tokens
            self.stats[2] += len(hit) * self.bs
        else:
            held.extend(new)
        return hit + new

    def register(self, req_id: str, tokens: list[int], num_computed: int) -> None:
        if not self.caching:
            return
        table, done = self.tables[req_id], self.registered[req_id]
        upto = min(num_computed // self.bs, len(tokens) // self.bs, len(table))
        for i in range(done, upto):
            key = tuple(tokens[: (i + 1) * self.bs])
            if table[i] not in self.key_of and key not in self.index:  # first writer wins
                self.index[key], self.key_of[table[i]] = table[i], key
            elif table[i] not in self.key_of:
                event("twin block left unregistered")
        self.registered[req_id] = max(done, upto)

    def free(self, req_id: str) -> None:
        self.registered.pop(req_id)
        for b in reversed(self.tables.pop(req_id)):  # tail first: evicted before the head
            self.refs[b] -= 1
            if self.refs[b] == 0:
                (self.free_cached if b in self.key_of else self.free_plain).append(b)

    def reset(self) -> None:
        self.free_plain += self.free_cached
        self.free_cached = []
        self.index, self.key_of = {}, {}


class _Hashes:
    """Chained block hashes of token prefixes, as requests compute them."""

    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self._memo: dict[tuple[int, ...], BlockHash] = {}

    def __call__(self, key: tuple[int, ...]) -> BlockHash:
        if key not in self._memo:
            parent = self(key[: -self.bs]) if len(key) > self.bs else None
            self._memo[key] = hash_block_tokens(parent, list(key[-self.bs:]))
        return self._memo[key]


class KVCacheManagerMachine(RuleBasedStateMachine):
    """The scheduler's use of the manager: admit, schedule, step, decode, free."""

    @initialize(
        num_blocks=st.integers(3, 16),
        block_size=st.integers(1, 4),
        caching=st.booleans().map(lambda off: not off),  # shrinks towards caching on
    )
    def setup(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.bs = block_size
        self.kv = KVCacheManager(num_blocks, block_size, enable_caching=caching)
        self.ref = RefKV(num_blocks, block_size, caching)
        self.hash = _Hashes(block_size)
        self.live: dict[str, Request] = {}
        self.pending: dict[str, int] = {}  # tokens scheduled, not yet computed
        self.store: dict[int, dict[int, tuple[int, ...]]] = {}  # fake KV: block -> offset -> prefix

    # -- helpers ---------------------------------------------------------------

    def _allocate(self, req: Request, num_new: int, hit: list[int] | None = None) -> list[int] | None:
        hit = hit or []
        num_hit = len(hit) * self.bs
        total = req.num_computed_tokens + num_hit + num_new
        want = self.ref.allocate(req.request_id, total, list(hit), req.num_tokens)
        got = self.kv.allocate_slots(req, num_new, hit, num_hit)
        assert got == want, f"allocated {got}, the reference says {want}"
        for key in self.ref.evicted:  # an evicted block's hash no longer hits
            assert self.kv.pool.get_cached_block(self.hash(key)) is None
        event("allocation refused" if got is None else "cached block evicted" if self.ref.evicted else "allocated")
        return got

    def _read_prefix(self, req: Request, upto: int) -> None:
        """'Attention' over the first ``upto`` positions: each slot holds that exact prefix."""
        table, tokens = self.kv.get_block_ids(req.request_id), req.all_token_ids
        for pos in range(upto):
            got = self.store.get(table[pos // self.bs], {}).get(pos % self.bs)
            assert got == tuple(tokens[: pos + 1]), f"{req.request_id}: wrong KV at position {pos}"

    # -- rules -----------------------------------------------------------------

    def _admit(self, rid: str, tokens: list[int], chunk: int) -> None:
        req = Request(rid, tokens, SamplingParams())
        update_block_hashes(req, self.bs)
        hit, num_hit = self.kv.get_computed_blocks(req)
        assert hit == self.ref.hit(tokens) and num_hit == len(hit) * self.bs
        event(f"hit of {len(hit)} blocks" if hit else "miss")
        for pos in range(num_hit):  # a hit serves exactly the KV of the request's own prefix
            assert self.store.get(hit[pos // self.bs], {}).get(pos % self.bs) == tuple(tokens[: pos + 1])
        num_new = min(chunk, len(tokens) - num_hit)
        if self._allocate(req, num_new, hit) is None:
            return  # no room: the request keeps waiting, nothing changed
        req.num_computed_tokens = num_hit
        self.live[rid] = req
        self.pending[rid] = num_new

    def _schedule_more(self, rid: str, chunk: int, token: int) -> None:
        """A running request's next chunk, or a decode once its known tokens are computed."""
        req = self.live[rid]
        if req.num_computed_tokens == req.num_tokens:  # decode: the last step sampled a token
            req.append_output_token(token)
            update_block_hashes(req, self.bs)
        num_new = min(chunk, req.num_tokens - req.num_computed_tokens)
        if self._allocate(req, num_new) is not None:
            self.pending[rid] = num_new
        else:  # no room: the scheduler preempts the request, freeing its blocks
            event("preempted")
            self._free(rid)

    def _run(self) -> None:
        """The worker computes every scheduled token, then blocks are registered."""
        for rid, n in self.pending.items():
            req = self.live[rid]
            start = req.num_computed_tokens
            self._read_prefix(req, start)
            table = self.kv.get_block_ids(rid)
            for pos in range(start, start + n):
                self.store.setdefault(table[pos // self.bs], {})[pos % self.bs] = tuple(req.all_token_ids[: pos + 1])
            req.num_computed_tokens += n
            self.pending[rid] = 0
        for rid, req in self.live.items():
            self.kv.cache_blocks(req, req.num_computed_tokens)
            self.ref.register(rid, req.all_token_ids, req.num_computed_tokens)

    # -- rules -----------------------------------------------------------------

    # Strategies shrink towards their simplest value, which hypothesis also
    # favours when generating: make that the whole shared base, fed in one chunk.
    PROMPT = st.tuples(
        st.integers(0, len(BASE)).map(lambda n: len(BASE) - n),  # tokens of the shared base
        st.lists(TAIL_TOKENS, max_size=4),  # then a tail
        st.integers(0, 15).map(lambda c: 16 - c),  # first chunk
    )

    @rule(data=st.data(), new=st.lists(PROMPT, max_size=2))
    def step(self, data, new: list[tuple[int, list[int], int]]) -> None:
        """One engine step: running requests get their next chunk or decode (or are
        preempted when the pool is short), new ones are admitted with a prefix hit,
        then every scheduled token is computed. Two requests admitted in one step
        with the same prefix both compute it (the second's blocks stay unregistered)."""
        running = sorted(self.live)
        chunks = data.draw(st.lists(st.tuples(st.integers(1, 16), TAIL_TOKENS), min_size=len(running),
                                    max_size=len(running)), label="(chunk, token) per running request")
        for rid, (chunk, token) in zip(running, chunks):
            self._schedule_more(rid, chunk, token)
        for base_len, tail, chunk in new:
            free_ids = [r for r in REQUEST_IDS if r not in self.live]
            if free_ids:
                self._admit(free_ids[0], BASE[:base_len] + tail or [0], chunk)
        self._run()

    @rule(data=st.data())
    def free(self, data) -> None:
        """Finish or abort a request."""
        if self.live:
            self._free(data.draw(st.sampled_from(sorted(self.live)), label="request"))

    def _free(self, rid: str) -> None:
        self.kv.free(self.live.pop(rid))
        self.ref.free(rid)
        del self.pending[rid]

    @rule(now=RARELY)
    def reset_prefix_cache(self, now: bool) -> None:
        if not now:
            return
        self.kv.reset_prefix_cache()
        self.ref.reset()

    # -- invariants ------------------------------------------------------------

    @invariant()
    def counts_and_refs_match(self) -> None:
        pool = self.kv.pool
        assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
        assert pool.num_free_blocks == self.ref.num_free
        refs = [b.ref_cnt for b in pool.blocks]
        assert min(refs) >= 0
        assert refs == self.ref.refs
        assert sum(refs) == sum(len(t) for t in self.kv.req_to_blocks.values())
        assert self.kv.req_to_blocks == self.ref.tables
        assert [self.kv.stats.num_queries, self.kv.stats.query_tokens, self.kv.stats.hit_tokens] == self.ref.stats

    @invariant()
    def index_matches_and_serves_the_right_kv(self) -> None:
        pool = self.kv.pool
        assert pool.num_cached_blocks == len(self.ref.index)
        for key, block in self.ref.index.items():
            assert pool.get_cached_block(self.hash(key)) == block
            assert pool.blocks[block].block_hash == self.hash(key)
            first = len(key) - self.bs  # the block's first position
            for off in range(self.bs):
                assert self.store[block][off] == key[: first + off + 1], f"block {block} holds other KV"
        for block in self.ref.free_plain:
            assert pool.blocks[block].block_hash is None

    def teardown(self) -> None:
        for req in list(getattr(self, "live", {}).values()):
            self.kv.free(req)
        if hasattr(self, "kv"):  # nothing referenced once every request is gone
            assert self.kv.num_free_blocks == self.kv.num_blocks and not self.kv.req_to_blocks


class BlockPoolMachine(RuleBasedStateMachine):
    """The pool alone: allocate, hit (touch), register under a hash, free, reset.

    Hashes come from a tiny alphabet so that twins (two blocks computing the
    same content) are common; each block's "content" is the hash it was
    computed under, and a hit must always return a block holding its key's.
    """

    @initialize(num_blocks=st.integers(1, 8), caching=st.booleans().map(lambda off: not off))
    def setup(self, num_blocks: int, caching: bool) -> None:
        self.pool = BlockPool(num_blocks, enable_caching=caching)
        self.ref = RefKV(num_blocks, 1, caching)  # keys are 1-tuples: (content,)
        self.held: list[int] = []  # one entry per reference the test holds
        self.content: dict[int, int] = {}  # block -> content written to it

    @staticmethod
    def _hash(content: int) -> BlockHash:
        return hash_block_tokens(None, [content])

    def _take(self, n: int) -> list[int]:
        want = self.ref.allocate("_", n, [], n) if n <= self.ref.num_free else None
        self.ref.tables.pop("_", None)
        if want is None:
            with pytest.raises(RuntimeError, match="only"):
                self.pool.get_new_blocks(n)
            return []
        got = self.pool.get_new_blocks(n)
        assert got == want  # plain blocks first, then cached ones least recently freed first
        for key in self.ref.evicted:
            assert self.pool.get_cached_block(self._hash(key[0])) is None
        return got

    @rule(n=st.integers(0, 4), contents=st.lists(st.integers(0, 3), min_size=4, max_size=4))
    def allocate_and_write(self, n: int, contents: list[int]) -> None:
        for block, content in zip(self._take(n), contents):
            self.held.append(block)
            self.content[block] = content

    @rule(data=st.data())
    def register(self, data) -> None:
        """Register a held block under the hash of its content (first writer wins)."""
        if not self.held:
            return
        block = data.draw(st.sampled_from(self.held), label="block")
        content = self.content[block]
        self.pool.cache_full_blocks([block], [self._hash(content)])
        if self.ref.caching and block not in self.ref.key_of and (content,) not in self.ref.index:
            self.ref.index[(content,)], self.ref.key_of[block] = block, (content,)

    @rule(content=st.integers(0, 3))
    def hit(self, content: int) -> None:
        block = self.pool.get_cached_block(self._hash(content))
        assert block == self.ref.index.get((content,))
        if block is None:
            return
        assert self.content[block] == content  # a hit holds exactly the keyed content
        self.pool.touch([block])
        if self.ref.refs[block] == 0:
            self.ref.free_cached.remove(block)
        self.ref.refs[block] += 1
        self.held.append(block)

    @rule(data=st.data())
    def free_some(self, data) -> None:
        if not self.held:
            return
        order = data.draw(st.permutations(range(len(self.held))), label="order")
        k = data.draw(st.integers(1, len(self.held)), label="count")
        picked = [self.held[i] for i in order[:k]]
        for i in sorted(order[:k], reverse=True):
            del self.held[i]
        self.pool.free_blocks(picked)
        for block in picked:  # queued in the order given
            self.ref.refs[block] -= 1
            if self.ref.refs[block] == 0:
                (self.ref.free_cached if block in self.ref.key_of else self.ref.free_plain).append(block)

    @rule(data=st.data())
    def double_free_is_refused(self, data) -> None:
        if all(self.ref.refs):
            return
        block = data.draw(st.sampled_from([b for b, r in enumerate(self.ref.refs) if r == 0]), label="block")
        with pytest.raises(RuntimeError, match="double free"):
            self.pool.free_blocks([block])

    @rule(now=RARELY)
    def reset(self, now: bool) -> None:
        if not now:
            return
        self.pool.reset_prefix_cache()
        self.ref.reset()

    @invariant()
    def matches_reference(self) -> None:
        pool = self.pool
        assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
        assert pool.num_free_blocks == self.ref.num_free
        assert [b.ref_cnt for b in pool.blocks] == self.ref.refs
        assert all(b.ref_cnt >= 0 for b in pool.blocks)
        assert sorted(self.held) == sorted(b for b, r in enumerate(self.ref.refs) for _ in range(r))
        assert pool.num_cached_blocks == len(self.ref.index)
        for (content,), block in self.ref.index.items():
            assert pool.get_cached_block(self._hash(content)) == block
            assert self.content[block] == content
        for block in range(pool.num_blocks):
            assert pool.is_free(block) == (self.ref.refs[block] == 0)


TestKVCacheManagerProperties = KVCacheManagerMachine.TestCase
TestBlockPoolProperties = BlockPoolMachine.TestCase
