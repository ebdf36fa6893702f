"""vLLM v1's prefix-caching semantics in the simulated engine's block pool (pure)."""

from __future__ import annotations

from kvevents.vllm import BlockStored
from sim_engine.block_pool import BlockPool, CacheKeys, chain_hashes

BS = 4


def tokens(n_blocks: int, base: int = 10) -> list[int]:
    return [base + i for i in range(n_blocks * BS)]


def kinds(pool: BlockPool) -> list[tuple]:
    return [(type(e).__name__, tuple(getattr(e, "block_hashes", ()))) for e in pool.take_events()]


def test_block_zero_is_the_null_block():
    pool = BlockPool(5, BS)
    assert pool.num_free == 4
    assert [b.block_id for b in pool.allocate(4)] == [1, 2, 3, 4]
    assert pool.usage == 1.0


def test_stored_blocks_are_announced_with_parent_tokens_and_salt():
    pool = BlockPool(8, BS)
    toks = tokens(3)
    hashes = chain_hashes(toks, BS, CacheKeys("s"))
    blocks = pool.allocate(3)
    pool.cache(blocks, hashes[:1], toks, 0, CacheKeys("s"))
    pool.cache(blocks, hashes, toks, 1, CacheKeys("s"))
    first, second = pool.take_events()
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
    assert (first.block_hashes, first.parent_block_hash, first.extra_keys) == ((hashes[0],), None, (["s"],))
    assert (second.block_hashes, second.parent_block_hash) == (tuple(hashes[1:]), hashes[0])
    assert second.token_ids == tuple(toks[BS:]) and second.extra_keys == (None, None)
    assert chain_hashes(toks, BS, CacheKeys()) != hashes  # the salt separates caches


def test_a_hit_is_capped_one_token_short_of_the_prompt():
    pool = BlockPool(8, BS)
    toks = tokens(2)
    hashes = chain_hashes(toks, BS, CacheKeys())
    blocks = pool.allocate(2)
    pool.cache(blocks, hashes, toks, 0, CacheKeys())
    assert len(pool.longest_hit(hashes, len(toks))) == 1  # 8 tokens: at most 7 may hit
    assert len(pool.longest_hit(hashes, len(toks) + 1)) == 2


def test_freed_cached_blocks_are_evicted_tail_first_and_uncached_ones_reused_first():
    pool = BlockPool(6, BS)  # 5 usable
    toks = tokens(2)
    hashes = chain_hashes(toks, BS, CacheKeys())
    blocks = pool.allocate(3)  # 2 full blocks + a partial one
    pool.cache(blocks, hashes, toks, 0, CacheKeys())
    pool.take_events()
    pool.free(list(reversed(blocks)))
    # Queue: the partial block first (reused first), then blocks 4, 5, then the chain tail-first.
    order = [b.block_id for b in pool.allocate(5)]
    assert order == [3, 4, 5, 2, 1]
    assert kinds(pool) == [("BlockRemoved", (hashes[1],)), ("BlockRemoved", (hashes[0],))]


def test_touching_a_cached_free_block_takes_it_out_of_the_queue():
    pool = BlockPool(4, BS)
    toks = tokens(1)
    hashes = chain_hashes(toks, BS, CacheKeys())
    (block,) = pool.allocate(1)
    pool.cache([block], hashes, toks, 0, CacheKeys())
    pool.free([block])
    hit = pool.longest_hit(hashes, len(toks) + 1)
    assert hit == [block] and pool.evictable(hit) == 1
    pool.touch(hit)
    assert pool.num_free == 2 and block.ref_cnt == 1
    pool.allocate(2)  # the touched block is not among them: nothing is evicted
    pool.take_events()
    assert pool.cached_block(hashes[0]) is block


def test_a_second_copy_of_a_hash_is_stored_and_removed_on_its_own():
    pool = BlockPool(6, BS)
    toks = tokens(1)
    hashes = chain_hashes(toks, BS, CacheKeys())
    a, b = pool.allocate(2)
    pool.cache([a], hashes, toks, 0, CacheKeys())
    pool.cache([b], hashes, toks, 0, CacheKeys())
    assert kinds(pool) == [("BlockStored", (hashes[0],)), ("BlockStored", (hashes[0],))]
    pool.free([a])
    pool.free([b])
    pool.allocate(5)
    assert kinds(pool) == [("BlockRemoved", (hashes[0],)), ("BlockRemoved", (hashes[0],))]


def test_reset_prefix_cache_needs_an_idle_pool_and_sends_one_clear():
    pool = BlockPool(6, BS)
    toks = tokens(2)
    hashes = chain_hashes(toks, BS, CacheKeys())
    blocks = pool.allocate(2)
    pool.cache(blocks, hashes, toks, 0, CacheKeys())
    pool.take_events()
    assert not pool.reset_prefix_cache()
    pool.free(list(reversed(blocks)))
    assert pool.reset_prefix_cache()
    assert kinds(pool) == [("AllBlocksCleared", ())]
    assert pool.cached_block(hashes[0]) is None
    pool.allocate(5)
    assert kinds(pool) == []  # nothing left to evict
