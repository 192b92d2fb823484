"""Per-request KV block tables on top of the block pool."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from omnistage.core.block_pool import BlockPool
from omnistage.core.kv_cache_utils import cdiv
from omnistage.core.request import Request


@dataclass
class PrefixCacheStats:
    """Counted once per admission (a resumed request counts again)."""

    num_queries: int = 0  # requests looked up
    query_tokens: int = 0  # their num_tokens
    hit_tokens: int = 0  # of which served from the cache


class KVCacheManager:
    """Allocates KV blocks to requests and serves prefix-cache hits.

    Policy:

    - Keyed by: ``request.block_hashes`` (one chained SHA-256 per full block
      of the request's known tokens); a lookup walks them from the first block
      and stops at the first miss.
    - A hit covers full blocks only and never the whole request: it is capped
      at ``num_tokens - 1`` tokens so that the last known token is fed to the
      model again and yields logits to sample from. A request asking for
      prompt logprobs gets no hit: its prompt's positions must all run.
    - Caching: a request's full blocks are registered once their KV is
      computed (``cache_blocks``, called after each step), including blocks
      filled by generated tokens. Registering after compute, not at
      allocation, means a hit never points at a block another request of the
      same step is still writing, so the worker's per-token tensor cache never
      serves rows not yet written.
    - Freeing: ``free`` drops the request's references tail block first; the
      blocks stay cached (see ``BlockPool``) until a new block is needed.
    - Block tables are append-only: blocks are added, never replaced.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"KVCacheManager.block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[int]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # leading blocks of the request already registered
        self.stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    @property
    def usage(self) -> float:
        return self.pool.num_used_blocks / self.pool.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def get_block_ids(self, req_id: str) -> list[int]:
        return self.req_to_blocks.get(req_id, [])

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached prefix of a request that holds no blocks yet:
        ``(block ids, number of tokens)``. Pure lookup: takes no references
        (``allocate_slots`` does) and counts no stats."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0  # a hit would skip the positions whose prompt logprobs the request asks for
        max_blocks = (request.num_tokens - 1) // self.block_size
        hit: list[int] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block_id = self.pool.get_cached_block(block_hash)
            if block_id is None:
                break
            hit.append(block_id)
        return hit, len(hit) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[int] = (),
        num_new_computed_tokens: int = 0,
    ) -> list[int] | None:
        """Make room for ``num_new_tokens`` tokens after the request's computed
        ones (``request.num_computed_tokens`` plus, on admission, the prefix
        hit ``new_computed_blocks`` covering ``num_new_computed_tokens``).

        Returns the newly allocated block ids (hit blocks first), or None when
        the pool cannot supply them; in that case nothing changes.
        """
        blocks = self.req_to_blocks.get(request.request_id)
        admitting = blocks is None
        held = 0 if blocks is None else len(blocks)
        total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_new = max(0, self.num_blocks_for(total) - held - len(new_computed_blocks))
        # Hit blocks that sit in the free queue leave it when touched.
        num_revived = sum(1 for b in new_computed_blocks if self.pool.is_free(b))
        if num_new + num_revived > self.pool.num_free_blocks:
            return None
        self.pool.touch(new_computed_blocks)
        new_ids = list(new_computed_blocks) + self.pool.get_new_blocks(num_new)
        if admitting:
            self.req_to_blocks[request.request_id] = list(new_ids)
            # Hit blocks are registered already; count them as such.
            self._num_cached_blocks[request.request_id] = len(new_computed_blocks)
            self.stats.num_queries += 1
            self.stats.query_tokens += request.num_tokens
            self.stats.hit_tokens += num_new_computed_tokens
        else:
            blocks.extend(new_ids)
        return new_ids

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's blocks that are full and computed up to
        ``num_computed_tokens``. Needs ``request.block_hashes`` up to date."""
        if not self.enable_caching:
            return
        req_id = request.request_id
        blocks = self.req_to_blocks.get(req_id)
        if blocks is None:
            return
        done = self._num_cached_blocks[req_id]
        upto = min(num_computed_tokens // self.block_size, len(request.block_hashes), len(blocks))
        if upto > done:
            self.pool.cache_full_blocks(blocks[done:upto], request.block_hashes[done:upto])
            self._num_cached_blocks[req_id] = upto

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first (evicted before the head)."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (see ``BlockPool.reset_prefix_cache``).
        Running requests keep their blocks; the blocks they fill from now on
        are registered as usual."""
        self.pool.reset_prefix_cache()
