"""The pool of KV-cache blocks: ids, reference counts and the prefix-cache index."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from omnistage.core.kv_cache_utils import BlockHash

# ("stored", hash): a block became hittable; ("removed", hash): it no longer is;
# ("cleared", None): every hash was forgotten.
KVEvent = tuple[str, BlockHash | None]


@dataclass(slots=True)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None  # set once the block is full and registered


class BlockPool:
    """Owns ``num_blocks`` KV blocks and the index of cached ones.

    Policy:

    - Keyed by: a full block's chained SHA-256 (``kv_cache_utils``) maps to
      the one block id holding that content. Only full blocks whose KV has been
      computed are registered (``cache_full_blocks``). If a second block
      computes the same content (two requests prefilling the same prefix at
      once), the first registration stays and the second block remains an
      ordinary, unshared block: block tables are append-only, so an allocated
      block is never swapped for a cached twin.
    - Reference counts: one per request whose block table holds the block.
      A block whose count drops to zero is *free* but keeps its hash, so it can
      still be hit and revived (``touch``).
    - Eviction: only when a new block is needed. Free blocks without a hash
      are handed out first (reusing them loses nothing); then cached free
      blocks in least-recently-freed order. Blocks freed in one call are
      queued in the order given; the KV cache manager passes a request's
      blocks tail first, so a request's tail is evicted before its head, which
      keeps the most shareable prefix longest.
    - A hit guarantees the block holds the KV of exactly the keyed prefix: a
      block's hash is dropped the moment it is handed out again.
    - Events (off unless ``record_events()`` was called): every change to the
      index, in order, for a router outside the engine that tracks which
      replica caches which block (``take_events``). Unbounded until taken, so
      whoever turns them on takes them every step.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"BlockPool.num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free_plain: deque[int] = deque(range(num_blocks))  # free, no hash
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # free with hash; LRU first
        self._cached: dict[BlockHash, int] = {}
        self._events: list[KVEvent] | None = None

    # -- queries -----------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that ``get_new_blocks`` can hand out (cached free ones included)."""
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        return self._cached.get(block_hash)

    def is_free(self, block_id: int) -> bool:
        return self.blocks[block_id].ref_cnt == 0

    # -- events ------------------------------------------------------------

    def record_events(self) -> None:
        """Start recording index changes (see the class docstring)."""
        if self._events is None:
            self._events = []

    def take_events(self) -> list[KVEvent]:
        """The index changes since the last call, oldest first."""
        events, self._events = self._events or [], ([] if self._events is not None else None)
        return events

    # -- mutations ---------------------------------------------------------

    def get_new_blocks(self, n: int) -> list[int]:
        """Hand out ``n`` blocks with ``ref_cnt == 1``, evicting cached free
        blocks (LRU first) when no plain free block is left."""
        if n > self.num_free_blocks:
            raise RuntimeError(f"BlockPool: asked for {n} blocks, only {self.num_free_blocks} free")
        out: list[int] = []
        for _ in range(n):
            if self._free_plain:
                block_id = self._free_plain.popleft()
            else:
                block_id, _ = self._free_cached.popitem(last=False)
                self._evict(self.blocks[block_id])
            self.blocks[block_id].ref_cnt = 1
            out.append(block_id)
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on cached blocks a request hit, reviving free ones."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self._free_cached[block_id]  # a hit block always has a hash
            block.ref_cnt += 1

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block; blocks reaching zero are queued
        for eviction in the order given (first given, first evicted)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt <= 0:
                raise RuntimeError(f"BlockPool: double free of block {block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self._free_plain.append(block_id)
                else:
                    self._free_cached[block_id] = None

    def cache_full_blocks(self, block_ids: Sequence[int], block_hashes: Sequence[BlockHash]) -> None:
        """Register full, computed blocks under their hashes (first writer wins)."""
        if not self.enable_caching:
            return
        for block_id, block_hash in zip(block_ids, block_hashes, strict=True):
            block = self.blocks[block_id]
            if block.block_hash is not None or block_hash in self._cached:
                continue
            block.block_hash = block_hash
            self._cached[block_hash] = block_id
            if self._events is not None:
                self._events.append(("stored", block_hash))

    def reset_prefix_cache(self) -> None:
        """Forget every hash. Blocks in use keep their contents and owners;
        they are just no longer found by lookups. Free cached blocks become
        plain free blocks, appended in LRU order."""
        for block_id in self._free_cached:
            self._free_plain.append(block_id)
        self._free_cached.clear()
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        if self._events is not None:
            self._events.append(("cleared", None))

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None and self._cached.get(block.block_hash) == block.block_id:
            del self._cached[block.block_hash]
            if self._events is not None:
                self._events.append(("removed", block.block_hash))
        block.block_hash = None
