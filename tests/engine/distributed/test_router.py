"""The router's view of the replicas' caches, without Ray: the block-pool
events keep it equal to each pool's index; a prompt hashes router-side to the
scheduler's own chain; choosing follows the documented policy."""

from __future__ import annotations

import random

import pytest

from omnistage.core.block_pool import BlockPool
from omnistage.core.kv_cache_utils import hash_block_tokens, hash_prompt_blocks, update_block_hashes
from omnistage.core.request import Request
from omnistage.engine.distributed.router import PrefixRouter
from omnistage.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from omnistage.sampling_params import SamplingParams


def test_events_keep_the_router_equal_to_every_pool():
    """Random allocations, registrations, frees, evictions and a reset on three
    pools; after each round the router's blocks of replica i are pool i's."""
    rng = random.Random(0)
    pools = [BlockPool(12) for _ in range(3)]
    for pool in pools:
        pool.record_events()
    router = PrefixRouter(3)
    shared = [hash_block_tokens(None, [i]) for i in range(20)]  # the same content on several replicas
    held: list[list[int]] = [[] for _ in pools]
    for step in range(300):
        i = rng.randrange(3)
        pool = pools[i]
        if held[i] and (rng.random() < 0.5 or pool.num_free_blocks == 0):
            pool.free_blocks([held[i].pop(rng.randrange(len(held[i])))])
        else:
            (block,) = pool.get_new_blocks(1)  # may evict a cached block: a "removed" event
            held[i].append(block)
            pool.cache_full_blocks([block], [rng.choice(shared)])
        if step == 150:
            pools[1].reset_prefix_cache()
        router.apply_events(i, pool.take_events())
        for j, p in enumerate(pools):
            router.apply_events(j, p.take_events())
            mine = {h for h, mask in router._holders.items() if mask >> j & 1}
            assert mine == set(p._cached), (step, j)
            assert router.num_cached_blocks(j) == p.num_cached_blocks
    assert pools[0].take_events() == []  # taken: nothing twice


def test_a_pool_records_nothing_unless_asked():
    pool = BlockPool(4)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([block], [hash_block_tokens(None, [1])])
    assert pool.take_events() == []


def test_router_side_hashes_equal_the_schedulers():
    image = MultiModalFeatureSpec(None, "image", "img-a", PlaceholderRange(3, 6))
    tokens = list(range(100, 117))
    request = Request("r", tokens, SamplingParams(), mm_features=[image], cache_salt="tenant")
    update_block_hashes(request, 4)
    assert hash_prompt_blocks(tokens, 4, [image], "tenant") == request.block_hashes
    assert len(request.block_hashes) == 4
    assert hash_prompt_blocks(tokens, 4, [image]) != request.block_hashes  # the salt is in the chain


def _stored(*hashes):
    return [("stored", h) for h in hashes]


def test_longest_prefix_then_least_loaded():
    chain = hash_prompt_blocks(list(range(16)), 4)
    router = PrefixRouter(3, max_imbalance=2)
    router.apply_events(0, _stored(chain[0]))
    router.apply_events(1, _stored(*chain[:3]))
    router.apply_events(2, _stored(*chain[:3]))
    assert router.choose(chain, [0, 1, 0]) == (2, 3)  # replicas 1 and 2 hold 3 blocks; 2 is less loaded
    assert router.choose(chain, [0, 1, None]) == (1, 3)  # 2 is dead
    assert router.choose(chain, [0, 3, None]) == (0, 0)  # 1 is more than max_imbalance behind
    assert router.choose(hash_prompt_blocks([9] * 8, 4), [2, 1, 1]) == (1, 0)  # no hit: least loaded, lowest id
    router.forget_replica(1)
    assert router.choose(chain, [0, 0, None]) == (0, 1)
    with pytest.raises(RuntimeError, match="no engine replica is alive"):
        router.choose(chain, [None, None, None])


def test_round_robin_and_least_loaded_ignore_the_caches():
    chain = hash_prompt_blocks(list(range(8)), 4)
    rr = PrefixRouter(3, "round_robin")
    rr.apply_events(2, _stored(*chain))
    assert [rr.choose(chain, [0, None, 0])[0] for _ in range(4)] == [0, 2, 0, 2]
    ll = PrefixRouter(2, "least_loaded")
    ll.apply_events(1, _stored(*chain))
    assert ll.choose(chain, [0, 0]) == (0, 0)
    with pytest.raises(ValueError, match="routing policy"):
        PrefixRouter(2, "random")
