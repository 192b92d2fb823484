"""Which replica gets a request: the longest cached prefix, else the least loaded.

The router mirrors the replicas' KV prefix caches from the events their block
pools record (``BlockPool.record_events``): a map from block hash to the
bitmask of replicas that hold the block. A request's own block hashes
(``hash_prompt_blocks``, the chain the scheduler computes) are walked from the
first block, intersecting masks, until no replica holds the next block.

Policy:

- ``"prefix"``: the replicas holding the longest prefix, least loaded among
  them, unless that replica carries more than ``max_imbalance`` requests over
  the least loaded live replica (a cache hit is not worth a queue); no hit:
  the least loaded replica. Ties go to the lowest index.
- ``"round_robin"``: live replicas in turn (the baseline of the benchmark).
- ``"least_loaded"``: ignore the caches.

Cost: state is one entry per distinct cached block in the fleet (plus a bit per
replica holding it); choosing walks the request's blocks once, one dict
lookup each, whatever the number of replicas (docs/design.md, at 100 replicas).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from omnistage.core.block_pool import KVEvent
from omnistage.core.kv_cache_utils import BlockHash

__all__ = ["ROUTING_POLICIES", "PrefixRouter"]

ROUTING_POLICIES = ("prefix", "round_robin", "least_loaded")


class PrefixRouter:
    """Routing state for ``num_replicas`` replicas; loads are the caller's."""

    def __init__(self, num_replicas: int, policy: str = "prefix", max_imbalance: int = 64) -> None:
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy must be one of {ROUTING_POLICIES}, got {policy!r}")
        self.num_replicas = num_replicas
        self.policy = policy
        self.max_imbalance = max_imbalance
        self._holders: dict[BlockHash, int] = {}  # block hash -> bitmask of replicas caching it
        self._num_cached = [0] * num_replicas
        self._turn = itertools.count()

    @property
    def num_tracked_blocks(self) -> int:
        return len(self._holders)

    def num_cached_blocks(self, replica: int) -> int:
        return self._num_cached[replica]

    # -- the replicas' caches ---------------------------------------------------

    def apply_events(self, replica: int, events: Sequence[KVEvent]) -> None:
        bit = 1 << replica
        for kind, block_hash in events:
            if kind == "cleared":
                self.forget_replica(replica)
            elif kind == "stored":
                mask = self._holders.get(block_hash, 0)  # type: ignore[arg-type]
                if not mask & bit:
                    self._holders[block_hash] = mask | bit  # type: ignore[index]
                    self._num_cached[replica] += 1
            elif kind == "removed":
                mask = self._holders.get(block_hash, 0)  # type: ignore[arg-type]
                if mask & bit:
                    self._num_cached[replica] -= 1
                    if mask == bit:
                        del self._holders[block_hash]  # type: ignore[arg-type]
                    else:
                        self._holders[block_hash] = mask & ~bit  # type: ignore[index]

    def forget_replica(self, replica: int) -> None:
        """Drop everything a replica caches (it died, or reset its cache). O(tracked blocks): rare."""
        bit = 1 << replica
        for block_hash, mask in list(self._holders.items()):
            if mask & bit:
                if mask == bit:
                    del self._holders[block_hash]
                else:
                    self._holders[block_hash] = mask & ~bit
        self._num_cached[replica] = 0

    # -- choosing ------------------------------------------------------------------

    def longest_prefix(self, block_hashes: Sequence[BlockHash], live: int) -> tuple[int, int]:
        """(blocks matched, bitmask of the live replicas holding that many)."""
        holders, depth = live, 0
        for block_hash in block_hashes:
            mask = self._holders.get(block_hash, 0) & holders
            if not mask:
                break
            holders, depth = mask, depth + 1
        return depth, holders if depth else 0

    def choose(self, block_hashes: Sequence[BlockHash], loads: Sequence[int | None]) -> tuple[int, int]:
        """(replica, prefix blocks it holds) for a request; ``loads[i]`` is None for a dead replica.
        Raises RuntimeError when no replica is alive."""
        live_ids = [i for i, load in enumerate(loads) if load is not None]
        if not live_ids:
            raise RuntimeError("no engine replica is alive")
        if self.policy == "round_robin":
            return live_ids[next(self._turn) % len(live_ids)], 0
        least = min(live_ids, key=lambda i: (loads[i], i))
        if self.policy == "least_loaded":
            return least, 0
        live = sum(1 << i for i in live_ids)
        depth, holders = self.longest_prefix(block_hashes, live)
        if not depth:
            return least, 0
        best = min((i for i in live_ids if holders >> i & 1), key=lambda i: (loads[i], i))
        if loads[best] - loads[least] > self.max_imbalance:  # type: ignore[operator]
            return least, 0
        return best, depth
