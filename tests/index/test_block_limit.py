"""One engine cannot grow the index past its own capacity: the writer indexes at most the
engine's cache size (plus a small slack) and counts the stores it leaves out."""

from __future__ import annotations

import random

import pytest

from kvindex.redis_index import RedisIndex
from kvindex.redis_worker import capacity_limit
from kvindex.types import RemovedBlocks, StoredRun, WorkerInfo, WorkerLoad

LONG_TTL = 600_000


def chain(seed: int, length: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.getrandbits(64) for _ in range(length))


async def test_stores_beyond_the_engines_capacity_are_skipped_and_counted(redis_client, unique_name):
    index = RedisIndex(redis_client)
    handle = await index.register(WorkerInfo("a", unique_name, "http://a", 16), LONG_TTL)
    await handle.report_load(WorkerLoad(1, 0, 0.9, capacity_blocks=1000))
    limit = capacity_limit(1000)
    assert handle.block_limit == limit == 1031
    first = chain(1, 800)
    await handle.store([StoredRun(None, first)])
    result = await handle.store([StoredRun(None, chain(2, 400))])  # a mirror that ran away
    assert (result.applied, result.skipped) == (limit - 800, 800 + 400 - limit)
    assert handle.blocks_over_limit == 800 + 400 - limit
    assert (await index.stats(unique_name)).entries == limit == await handle.indexed_blocks()
    await handle.remove(first[::-1])  # room again: new stores are indexed
    assert await handle.indexed_blocks() == limit - 800
    third = chain(3, 100)
    await handle.store([StoredRun(None, third)])
    assert await index.match(unique_name, list(third)) == {"a": 100}
    assert handle.blocks_over_limit == 800 + 400 - limit  # unchanged


async def test_an_explicit_limit_overrides_the_reported_capacity(redis_client, unique_name):
    index = RedisIndex(redis_client)
    handle = await index.register(WorkerInfo("a", unique_name, "http://a", 16), LONG_TTL)
    handle.set_block_limit(10)
    await handle.report_load(WorkerLoad(0, 0, 0.0, capacity_blocks=1000))
    assert handle.block_limit == 10
    prompt = chain(4, 30)
    await handle.store([StoredRun(None, prompt)])
    assert await index.match(unique_name, list(prompt)) == {"a": 10} and handle.blocks_over_limit == 20
    handle.set_block_limit(None)  # back to the engine's capacity
    assert handle.block_limit == capacity_limit(1000)
    await handle.store([StoredRun(prompt[9], prompt[10:])])  # stored again: now they fit
    assert await index.match(unique_name, list(prompt)) == {"a": 30}
    await handle.apply([RemovedBlocks(prompt[::-1])])
    with pytest.raises(ValueError, match=">= 0"):
        handle.set_block_limit(-1)


async def test_a_reassert_writes_no_more_than_the_limit(redis_client, unique_name):
    index = RedisIndex(redis_client)
    handle = await index.register(WorkerInfo("a", unique_name, "http://a", 16), LONG_TTL)
    handle.set_block_limit(50)
    await handle.store([StoredRun(None, chain(5, 80))])
    await handle.reassert()
    assert await handle.indexed_blocks() == 50 == handle.mirror.indexed_count
