"""What readers can see of a worker's writes: one engine batch is one apply.lua call (all of it
or none of it), and a re-assert never shows the worker emptier than its old generation."""

from __future__ import annotations

import random

from kvindex.redis_index import MAX_ITEMS_PER_CALL, RedisIndex
from kvindex.types import RemovedBlocks, StoredRun, WorkerInfo

LONG_TTL = 600_000


def chain(seed: int, length: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.getrandbits(64) for _ in range(length))


async def applied_op(client, index: RedisIndex, model: str) -> int:
    """The record's op: one per apply.lua call this generation received."""
    return int(await client.hget(index.keys(model).worker("a"), "op"))


async def test_an_engine_batch_of_thousands_of_blocks_is_one_apply_call(redis_client, unique_name):
    index = RedisIndex(redis_client)
    handle = await index.register(WorkerInfo("a", unique_name, "http://a", 16), LONG_TTL)
    stored = chain(1, 5000)  # above the 4,096 operations one call used to carry
    evicted = chain(2, 3000)
    await handle.store([StoredRun(None, evicted)])
    await handle.apply([StoredRun(None, stored), RemovedBlocks(evicted[::-1])])
    assert await applied_op(redis_client, index, unique_name) == 2
    assert await index.match(unique_name, list(stored)) == {"a": 5000}
    assert await index.match(unique_name, list(evicted)) == {"a": 0}


async def test_batches_share_calls_and_only_an_oversized_one_is_split(redis_client, unique_name):
    index = RedisIndex(redis_client)
    handle = await index.register(WorkerInfo("a", unique_name, "http://a", 16), LONG_TTL)
    third = MAX_ITEMS_PER_CALL // 3 + 1  # two batches fit a call, three do not
    batches = [[StoredRun(None, chain(seed, third))] for seed in range(3)]
    await handle.apply_batches(batches)
    assert await applied_op(redis_client, index, unique_name) == 2 and handle.split_batches == 0
    await handle.apply([StoredRun(None, chain(9, MAX_ITEMS_PER_CALL + 10))])
    assert await applied_op(redis_client, index, unique_name) == 4 and handle.split_batches == 1
    assert (await index.stats(unique_name)).entries == 3 * third + MAX_ITEMS_PER_CALL + 10
