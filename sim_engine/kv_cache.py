"""Which blocks a request holds: vLLM's KVCacheManager over one full-attention group
(vllm/v1/core/kv_cache_manager.py and single_type_kv_cache_manager.py's FullAttentionManager),
the engine's default. :mod:`sim_engine.hybrid` extends it to a hybrid model's two groups.

The engine (sim_engine/engine.py) asks, in vLLM's ``allocate_slots`` order: a waiting request's
hit (:meth:`find_hit`), whether its whole sequence fits (:meth:`fits`), then takes the hit and the
blocks of its first chunk (:meth:`take`); a running request frees what it no longer reads
(:meth:`remove_skipped`), says how many blocks its next chunk needs (:meth:`needed`) and gets them
(:meth:`grow`); full blocks are cached as they are scheduled (:meth:`cache`); a finished or
preempted request frees its blocks (:meth:`free`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from sim_engine.block_pool import Block, BlockPool
from sim_engine.types import SimRequest, cdiv


@dataclass
class Hit:
    """A request's prefix-cache hit: the cached blocks each group reuses, and its length."""

    full: list[Block]  # the full-attention group's
    tokens: int
    window: list[Block] = field(default_factory=list)  # a hybrid model's sliding-window group's
    shared_prefix: int = 0  # a hybrid model's shared-prefix junction (vLLM's shared_prefix_boundary)


class KVCacheManager:
    """One full-attention group: a request's table is ``request.blocks``."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.block_size = pool.block_size

    def max_blocks(self, num_tokens: int) -> int:
        """The most blocks a request of ``num_tokens`` holds at once (more than the pool has:
        it can never run)."""
        return cdiv(num_tokens, self.block_size)

    def find_hit(self, hashes: Sequence[int], num_tokens: int) -> Hit:
        """The longest run of cached blocks, capped at ``num_tokens - 1`` tokens (the last token
        is computed for its logits). Changes nothing."""
        blocks = self.pool.longest_hit(hashes, num_tokens)
        return Hit(blocks, len(blocks) * self.block_size)

    def fits(self, hit: Hit, num_tokens: int, step_tokens: int) -> bool:
        """Whether the free blocks hold a request of ``num_tokens`` with ``hit`` (vLLM's
        ``scheduler_reserve_full_isl``; cached blocks in the free queue count as used once
        touched). ``step_tokens``, the first step's, take no more."""
        needed = cdiv(num_tokens, self.block_size) - len(hit.full) + self.pool.evictable(hit.full)
        return needed <= self.pool.num_free

    def take(self, request: SimRequest, hit: Hit, num_tokens: int) -> None:
        """Give an admitted request its hit and the blocks for ``num_tokens`` tokens."""
        self.pool.touch(hit.full)
        request.blocks = hit.full + self.pool.allocate(cdiv(num_tokens, self.block_size) - len(hit.full))
        request.num_cached_blocks = len(hit.full)

    def remove_skipped(self, request: SimRequest) -> None:
        """Free the blocks attention no longer reads: none, with full attention."""

    def needed(self, request: SimRequest, num_tokens: int) -> int:
        """The new blocks a running request needs to hold ``num_tokens`` tokens."""
        return max(cdiv(num_tokens, self.block_size) - len(request.blocks), 0)

    def grow(self, request: SimRequest, num_tokens: int) -> None:
        request.blocks += self.pool.allocate(self.needed(request, num_tokens))

    def cache(self, request: SimRequest, num_tokens: int) -> None:
        """Cache the full blocks of the first ``num_tokens`` tokens (``request.hashes`` has them)."""
        full = num_tokens // self.block_size
        start = request.num_cached_blocks
        self.pool.cache(request.blocks, request.hashes[:full], request.all_tokens, start, request.keys)
        request.num_cached_blocks = max(request.num_cached_blocks, min(full, len(request.blocks)))

    def free(self, request: SimRequest) -> None:
        """Release the request's blocks, its tail first (evicted first)."""
        self.pool.free(list(reversed(request.blocks)))
        request.blocks, request.num_cached_blocks = [], 0
