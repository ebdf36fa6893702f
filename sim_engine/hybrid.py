"""A hybrid model's KV cache: one sliding-window group (group 0) beside one full-attention group
(group 1), sharing one block pool, as vLLM 0.32's HybridKVCacheCoordinator runs a model whose
``layer_types`` are ``["sliding_attention", "full_attention"]`` (vllm/v1/core/
kv_cache_coordinator.py, single_type_kv_cache_manager.py's SlidingWindowManager). Checked
request by request against a real vLLM 0.32 capture (tests/unit/test_sim_hybrid.py).

* The pool: ``--num-gpu-blocks-override N`` gives N blocks that both groups draw from (each group's
  layers alias the same memory, one page per block), so a request holds a block table in each.
* The hit (``find_longest_cache_hit``, the "simple hybrid" case: full attention first, one pass):
  the full-attention group's longest run of cached blocks, capped at ``num_tokens - 1`` tokens;
  then, within it, the sliding window's: scanning from the right, the first run of
  ``cdiv(window - 1, block_size)`` cached blocks ends the hit (the blocks before it are not read),
  else the run held from block 0. The full-attention blocks are cut to that length. When the
  full-attention hit was longer, its end is the request's shared-prefix junction (vLLM's
  ``shared_prefix_boundary``), whose window the request caches for the next sibling.
* The window's blocks: blocks wholly before the window of the next token to compute
  (``num_computed - window + 1`` tokens) are never read again. A hit's are the null block in the
  table; a running request frees them when it is next scheduled (``remove_skipped_blocks``, before
  counting the blocks its chunk needs), from the last back, and puts the null block in their place.
* Caching: every full block of the full-attention group; of the window group's, with vLLM's
  default ``prefix_cache_retention_interval`` 0, only the blocks a later hit can end on: the
  ``cdiv(window - 1, block_size)`` blocks before the prompt's last full block boundary below its
  last token (a resend's hit), and before the shared-prefix junction. The window group's
  BlockStored has the span's tokens but only those blocks' hashes (maybe none); the hashes are the
  full-attention group's for the same blocks.
* Admission (``scheduler_reserve_full_isl``): the blocks of both groups for the whole sequence,
  the window group's capped at ``cdiv(min(window - 1 + max_num_batched_tokens, max_model_len),
  block_size) + 1`` (vLLM's ``max_admission_blocks_per_request``, synchronous scheduling).
* Freeing: group by group in group order (the window's first), each table tail first.

The CPU and disk tiers (sim_engine/offload.py) are not combined with it (the settings refuse both).
"""

from __future__ import annotations

from collections.abc import Sequence

from sim_engine.block_pool import FULL_ATTENTION, Block, BlockPool, KVCacheGroup
from sim_engine.kv_cache import Hit, KVCacheManager
from sim_engine.types import SimRequest, cdiv

WINDOW_GROUP, FULL_GROUP = 0, 1  # vLLM's group order for layer_types [sliding_attention, full_attention]


def hybrid_groups(sliding_window: int) -> tuple[KVCacheGroup, KVCacheGroup]:
    return KVCacheGroup("sliding_window", sliding_window), FULL_ATTENTION


class HybridKVCacheManager(KVCacheManager):
    """Both groups' tables: ``request.window_blocks`` and ``request.blocks`` (full attention)."""

    def __init__(self, pool: BlockPool, sliding_window: int, max_in_flight_tokens: int, max_model_len: int) -> None:
        super().__init__(pool)
        self.window = sliding_window
        # the cached blocks in a row that hold a whole window: a hit ends on such a run
        self.run = cdiv(sliding_window - 1, self.block_size)
        # tokens a request reads at once: the window before its chunk and the chunk in flight
        window_tokens = min(sliding_window - 1 + max_in_flight_tokens, max_model_len)
        # +1: the window need not start on a block boundary
        self.admission_cap = cdiv(window_tokens, self.block_size) + 1

    def max_blocks(self, num_tokens: int) -> int:
        blocks = cdiv(num_tokens, self.block_size)
        return blocks + min(blocks, self.admission_cap)

    def find_hit(self, hashes: Sequence[int], num_tokens: int) -> Hit:
        full = self.pool.longest_hit(hashes, num_tokens, group=FULL_GROUP)
        window = self._window_hit(hashes, len(full))
        tokens = len(window) * self.block_size
        longest = len(full) * self.block_size
        return Hit(full[: len(window)], tokens, window, longest if longest > tokens else 0)

    def _window_hit(self, hashes: Sequence[int], limit: int) -> list[Block]:
        """The window group's hit within the first ``limit`` blocks: the null block for each
        block before the run that ends it."""
        run: list[Block] = []
        for i in range(limit - 1, -1, -1):
            block = self.pool.cached_block(hashes[i], WINDOW_GROUP)
            if block is None:
                run = []
                continue
            run.insert(0, block)
            if len(run) >= self.run:
                return [self.pool.null] * i + run
        return run  # no whole window: the run held from block 0 (if any)

    def _skipped(self, num_computed: int) -> int:
        """Blocks wholly before the window of the token after ``num_computed`` ones."""
        return max(num_computed - self.window + 1, 0) // self.block_size

    def fits(self, hit: Hit, num_tokens: int, step_tokens: int) -> bool:
        # The whole sequence (the window's share capped), then the first step's blocks, as
        # allocate_slots checks both.
        free = self.pool.num_free
        return (
            self._to_allocate(hit, num_tokens, capped=True) <= free
            and self._to_allocate(hit, step_tokens, capped=False) <= free
        )

    def _to_allocate(self, hit: Hit, num_tokens: int, capped: bool) -> int:
        required = cdiv(num_tokens, self.block_size)
        full = required - len(hit.full) + self.pool.evictable(hit.full)
        skipped = self._skipped(hit.tokens)
        window_required = min(required, self.admission_cap) if capped else required
        window = max(window_required - max(skipped, len(hit.window)), 0)
        return full + window + self.pool.evictable(hit.window[skipped:])

    def take(self, request: SimRequest, hit: Hit, num_tokens: int) -> None:
        # Both groups' hits are touched before either allocates (so no allocation evicts the
        # other group's hit), the window group first.
        skipped = self._skipped(hit.tokens)
        kept = hit.window[skipped:]
        self.pool.touch(kept)
        self.pool.touch(hit.full)
        request.window_blocks = [self.pool.null] * skipped + kept
        request.num_window_cached = len(request.window_blocks)
        request.blocks = list(hit.full)
        request.num_cached_blocks = len(hit.full)
        request.shared_prefix = hit.shared_prefix
        self.grow(request, num_tokens)

    def remove_skipped(self, request: SimRequest) -> None:
        table = request.window_blocks
        freed = []
        for i in range(min(self._skipped(request.num_computed), len(table)) - 1, -1, -1):
            if table[i] is self.pool.null:
                break  # the ones before went earlier
            freed.append(table[i])
            table[i] = self.pool.null
        self.pool.free(freed)

    def needed(self, request: SimRequest, num_tokens: int) -> int:
        required = cdiv(num_tokens, self.block_size)
        return max(required - len(request.window_blocks), 0) + max(required - len(request.blocks), 0)

    def grow(self, request: SimRequest, num_tokens: int) -> None:
        required = cdiv(num_tokens, self.block_size)
        request.window_blocks += self.pool.allocate(max(required - len(request.window_blocks), 0))
        request.blocks += self.pool.allocate(max(required - len(request.blocks), 0))

    def cache(self, request: SimRequest, num_tokens: int) -> None:
        # The window group first, as the coordinator goes through its managers in group order.
        full = num_tokens // self.block_size
        tokens, hashes, keys = request.all_tokens, request.hashes[:full], request.keys
        start = request.num_window_cached
        if start < full:
            mask = self._window_mask(request, start, full)
            self.pool.cache(request.window_blocks, hashes, tokens, start, keys, group=WINDOW_GROUP, mask=mask)
            request.num_window_cached = full
        start = request.num_cached_blocks
        self.pool.cache(request.blocks, hashes, tokens, start, keys, group=FULL_GROUP)
        request.num_cached_blocks = max(start, min(full, len(request.blocks)))

    def _window_mask(self, request: SimRequest, start: int, end: int) -> list[bool]:
        """Which of blocks ``start:end`` a later hit can end on (vLLM's reachable_block_mask with
        retention interval 0): the window's run before each boundary a later request can resume
        at, a resend of the prompt (its last token recomputed) and the shared-prefix junction."""
        mask = [False] * (end - start)
        boundaries = [len(request.prompt) - 1] + ([request.shared_prefix] if request.shared_prefix else [])
        for boundary in boundaries:
            last = boundary // self.block_size  # the hit ends before this block
            for i in range(max(start, last - self.run), min(end, last)):
                mask[i - start] = True
        return mask

    def free(self, request: SimRequest) -> None:
        self.pool.free(list(reversed(request.window_blocks)))
        self.pool.free(list(reversed(request.blocks)))
        request.window_blocks, request.num_window_cached, request.shared_prefix = [], 0, 0
        request.blocks, request.num_cached_blocks = [], 0
