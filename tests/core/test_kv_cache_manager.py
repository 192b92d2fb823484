"""BlockPool and KVCacheManager: refcounts, LRU eviction, hit rules, stats."""

from __future__ import annotations

import pytest

from omnistage.core.block_pool import BlockPool
from omnistage.core.kv_cache_manager import KVCacheManager
from omnistage.core.kv_cache_utils import hash_block_tokens, update_block_hashes
from omnistage.core.request import Request
from omnistage.sampling_params import SamplingParams

BS = 4


def _h(i: int) -> bytes:
    return hash_block_tokens(None, [i])


def _req(rid: str, tokens: list[int]) -> Request:
    req = Request(rid, list(tokens), SamplingParams())
    update_block_hashes(req, BS)
    return req


def _admit(kv: KVCacheManager, req: Request, compute: bool = True) -> int:
    """Admit with a prefix lookup, schedule the rest, optionally 'compute' it."""
    hit, num_hit = kv.get_computed_blocks(req)
    n = req.num_tokens - num_hit
    assert kv.allocate_slots(req, n, hit, num_hit) is not None
    req.num_computed_tokens = num_hit + n
    if compute:
        kv.cache_blocks(req, req.num_computed_tokens)
    return num_hit


# -- BlockPool ---------------------------------------------------------------


def test_pool_refcounts_and_free_count():
    pool = BlockPool(4)
    a = pool.get_new_blocks(3)
    assert [pool.blocks[b].ref_cnt for b in a] == [1, 1, 1] and pool.num_free_blocks == 1
    pool.touch([a[0]])
    pool.free_blocks(a)
    assert pool.blocks[a[0]].ref_cnt == 1 and pool.num_free_blocks == 3
    pool.free_blocks([a[0]])
    assert pool.num_free_blocks == 4 and pool.num_used_blocks == 0
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([a[0]])
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(5)


def test_pool_lru_eviction_order_and_hit_revival():
    pool = BlockPool(4)
    ids = pool.get_new_blocks(4)
    pool.cache_full_blocks(ids, [_h(i) for i in range(4)])
    pool.free_blocks([ids[2], ids[0], ids[3], ids[1]])  # freed order = eviction order
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 4
    # A hit revives a free block: it leaves the eviction queue.
    assert pool.get_cached_block(_h(0)) == ids[0]
    pool.touch([ids[0]])
    assert pool.blocks[ids[0]].ref_cnt == 1 and pool.num_free_blocks == 3
    # Evictions follow freed order, skipping the revived block.
    assert pool.get_new_blocks(1) == [ids[2]]
    assert pool.get_cached_block(_h(2)) is None  # evicted: hash dropped
    assert pool.get_new_blocks(1) == [ids[3]]
    assert pool.get_cached_block(_h(1)) == ids[1]  # not yet evicted
    # Freed again later: goes to the back of the queue.
    pool.free_blocks([ids[0]])
    assert pool.get_new_blocks(1) == [ids[1]]
    assert pool.get_new_blocks(1) == [ids[0]]


def test_pool_hands_out_plain_blocks_before_evicting_cached_ones():
    pool = BlockPool(3)
    a = pool.get_new_blocks(2)
    pool.cache_full_blocks(a[:1], [_h(0)])  # a[0] cached, a[1] plain
    pool.free_blocks(a)
    got = pool.get_new_blocks(2)
    assert a[0] not in got  # the never-used block and the plain one went first
    assert pool.get_cached_block(_h(0)) == a[0]


def test_pool_first_writer_wins_and_no_dedupe():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [_h(7)])
    pool.cache_full_blocks([b], [_h(7)])  # same content computed twice
    assert pool.get_cached_block(_h(7)) == a
    assert pool.blocks[b].block_hash is None and pool.blocks[b].ref_cnt == 1  # b stays b's owner's
    pool.free_blocks([a, b])
    assert pool.num_free_blocks == 2


def test_pool_reset_and_caching_disabled():
    pool = BlockPool(2)
    ids = pool.get_new_blocks(2)
    pool.cache_full_blocks(ids, [_h(0), _h(1)])
    pool.free_blocks(ids[:1])
    pool.reset_prefix_cache()
    assert pool.get_cached_block(_h(0)) is None and pool.get_cached_block(_h(1)) is None
    assert pool.num_free_blocks == 1 and pool.blocks[ids[1]].ref_cnt == 1
    off = BlockPool(2, enable_caching=False)
    ids = off.get_new_blocks(1)
    off.cache_full_blocks(ids, [_h(0)])
    assert off.get_cached_block(_h(0)) is None


# -- KVCacheManager ------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt_len, expected_hit",
    [(1, 0), (4, 0), (5, 4), (8, 4), (9, 8), (11, 8), (12, 8), (13, 12)],
)
def test_hit_covers_full_blocks_and_leaves_last_token(prompt_len, expected_hit):
    kv = KVCacheManager(16, BS)
    _admit(kv, _req("a", list(range(16))))  # 4 full blocks cached
    assert _admit(kv, _req("b", list(range(prompt_len)))) == expected_hit


def test_hit_stops_at_first_differing_block():
    kv = KVCacheManager(16, BS)
    _admit(kv, _req("a", list(range(16))))
    tokens = list(range(16))
    tokens[5] = 99  # block 1 differs; block 2 equal but its parent differs
    assert _admit(kv, _req("b", tokens)) == 4


def test_refcounts_shared_blocks_and_clean_after_free():
    kv = KVCacheManager(8, BS)
    a, b = _req("a", list(range(9))), _req("b", list(range(9)))
    _admit(kv, a)
    assert _admit(kv, b) == 8
    shared = kv.get_block_ids("a")[:2]
    assert kv.get_block_ids("b")[:2] == shared
    assert [kv.pool.blocks[i].ref_cnt for i in shared] == [2, 2]
    assert kv.get_block_ids("a")[2] != kv.get_block_ids("b")[2]  # partial last block never shared
    kv.free(a)
    assert [kv.pool.blocks[i].ref_cnt for i in shared] == [1, 1]
    kv.free(b)
    assert kv.num_free_blocks == kv.num_blocks and all(blk.ref_cnt == 0 for blk in kv.pool.blocks)
    assert not kv.req_to_blocks


def test_tail_blocks_evicted_before_head():
    kv = KVCacheManager(3, BS)
    a = _req("a", list(range(12)))
    _admit(kv, a)
    kv.free(a)  # all 3 blocks free and cached
    other = _req("x", [50, 51, 52])
    assert kv.allocate_slots(other, 3) is not None  # needs 1 block: evicts a's tail
    kv.free(other)
    again = _req("a2", list(range(12)))
    assert kv.get_computed_blocks(again)[1] == 8  # head blocks survived


def test_allocate_fails_without_side_effects():
    kv = KVCacheManager(2, BS)
    a = _req("a", list(range(8)))
    _admit(kv, a)
    kv.free(a)  # 2 free cached blocks
    b = _req("b", list(range(8)) + [1])  # hits 2 blocks, needs a third
    hit, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    assert kv.allocate_slots(b, 1, hit, num_hit) is None
    assert kv.num_free_blocks == 2 and all(blk.ref_cnt == 0 for blk in kv.pool.blocks)
    assert "b" not in kv.req_to_blocks and kv.stats.num_queries == 1  # only a was counted


def test_blocks_filled_by_generated_tokens_are_cached():
    kv = KVCacheManager(8, BS)
    a = _req("a", [1, 2, 3, 4, 5, 6])
    _admit(kv, a)
    for t in (7, 8, 9):  # decode: generated tokens fill block 1
        a.append_output_token(t)
        update_block_hashes(a, BS)
        assert kv.allocate_slots(a, 1) is not None
        a.num_computed_tokens += 1
        kv.cache_blocks(a, a.num_computed_tokens)
    b = _req("b", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert kv.get_computed_blocks(b)[1] == 8


def test_blocks_registered_only_once_computed():
    kv = KVCacheManager(8, BS)
    a = _req("a", list(range(8)))
    assert kv.allocate_slots(a, 8) is not None  # allocated, KV not computed yet
    assert kv.get_computed_blocks(_req("b", list(range(9))))[1] == 0
    kv.cache_blocks(a, 5)  # one full block computed
    assert kv.get_computed_blocks(_req("b", list(range(9))))[1] == 4


def test_stats_and_reset():
    kv = KVCacheManager(8, BS)
    _admit(kv, _req("a", list(range(9))))
    _admit(kv, _req("b", list(range(9))))
    assert (kv.stats.num_queries, kv.stats.query_tokens, kv.stats.hit_tokens) == (2, 18, 8)
    assert kv.num_used_blocks == 4 and kv.usage == 0.5
    kv.reset_prefix_cache()
    assert kv.get_computed_blocks(_req("c", list(range(9))))[1] == 0


def test_caching_disabled_never_hits():
    kv = KVCacheManager(8, BS, enable_caching=False)
    _admit(kv, _req("a", list(range(9))))
    assert _admit(kv, _req("b", list(range(9)))) == 0
