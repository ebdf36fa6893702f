"""What readers can see of a worker's writes: one engine batch is one apply.lua call (all of it
or none of it), and a re-assert never shows the worker emptier than its old generation."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Awaitable, Callable

from redis.asyncio import Redis

from kvindex.codec import encode_ops
from kvindex.generations import stage_generation, swap_generation
from kvindex.keys import bucket_of
from kvindex.redis_index import MAX_ITEMS_PER_CALL, RedisIndex
from kvindex.types import RemovedBlocks, StoredRun, WorkerInfo
from tests.support import raw_call, wait_until

LONG_TTL = 600_000


def chain(seed: int, length: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.getrandbits(64) for _ in range(length))


async def applied_calls(client, index: RedisIndex, model: str, handle, root: int) -> int:
    """The op id of the gid's state in the bucket of ``root``'s chain: one per apply.lua call
    the bucket received for this generation."""
    state = index.keys(model).bucket_of_chain(root).state(handle.gid)
    return int(await client.hget(state, "op") or 0)


async def test_an_engine_batch_of_thousands_of_blocks_is_one_apply_call_per_bucket(redis_client, unique_name):
    index = RedisIndex(redis_client)
    handle = await index.register(WorkerInfo("a", unique_name, "http://a", 16), LONG_TTL)
    stored = chain(1, 5000)  # above the 4,096 operations one call used to carry
    evicted = chain(2, 1000)  # under RELOG_SLACK: no log compaction (which would take an op id)
    await handle.store([StoredRun(None, evicted)])
    await handle.apply([StoredRun(None, stored), RemovedBlocks(evicted[::-1])])
    assert await applied_calls(redis_client, index, unique_name, handle, stored[0]) == 1
    assert await applied_calls(redis_client, index, unique_name, handle, evicted[0]) == 2
    assert await index.match(unique_name, list(stored)) == {"a": 5000}
    assert await index.match(unique_name, list(evicted)) == {"a": 0}


async def test_batches_share_calls_and_only_an_oversized_one_is_split(redis_client, unique_name):
    index = RedisIndex(redis_client)
    handle = await index.register(WorkerInfo("a", unique_name, "http://a", 16), LONG_TTL)
    third = MAX_ITEMS_PER_CALL // 3 + 1  # two batches fit a call, three do not
    one = chain(0, 3 * third)  # one chain, so one bucket: three batches storing a third each
    batches = [[StoredRun(one[k * third - 1] if k else None, one[k * third : (k + 1) * third])] for k in range(3)]
    await handle.apply_batches(batches)
    assert await applied_calls(redis_client, index, unique_name, handle, one[0]) == 2
    assert handle.split_batches == 0
    big = chain(9, MAX_ITEMS_PER_CALL + 10)
    await handle.apply([StoredRun(None, big)])
    assert await applied_calls(redis_client, index, unique_name, handle, big[0]) == 2 and handle.split_batches == 1
    assert (await index.stats(unique_name)).entries == 3 * third + MAX_ITEMS_PER_CALL + 10


def watch(url: str, model: str, prompts: list[tuple[int, ...]], stop: threading.Event, seen: list[int]) -> None:
    """A router in another thread (its own event loop and connection), matching ``prompts``
    over and over until ``stop``: it sees the index between any two of the writer's calls."""

    async def loop() -> None:
        client = Redis.from_url(url)
        reader = RedisIndex(client)
        while not stop.is_set():
            for prompt in prompts:
                seen.append((await reader.match(model, list(prompt[:8]))).get("a", 0))
        await client.aclose()

    asyncio.run(loop())


async def test_a_reader_never_sees_the_worker_emptier_during_a_reassert(redis_server, unique_name):
    """A re-assert fills a staged gid while the old one stays matched, then swaps: a reader
    matching throughout sees every prompt whole, before, during and after."""
    client = Redis.from_url(redis_server.url)
    index = RedisIndex(client)
    try:
        handle = await index.register(WorkerInfo("a", unique_name, "http://a", 16), LONG_TTL)
        prompts = [chain(seed, 1000) for seed in range(40)]  # 40,000 blocks: three apply calls
        await handle.apply_batches([[StoredRun(None, p)] for p in prompts])
        # The prompts the refill writes last (in its last call): missing longest if it showed.
        order = {add.block: i for i, add in enumerate(handle.mirror.indexed_in_order())}
        last = sorted(prompts, key=lambda p: order[p[0]])[-3:]
        before = handle.registration
        stop, seen = threading.Event(), []
        reader = threading.Thread(target=watch, args=(redis_server.url, unique_name, last, stop, seen))

        def observed_since(count: int) -> Callable[[], Awaitable[bool]]:
            async def check() -> bool:
                return len(seen) > count + 3

            return check

        reader.start()
        try:
            await wait_until(observed_since(0), 10)  # the reader is matching
            after = await handle.reassert()
            await wait_until(observed_since(len(seen)), 10)  # and still after the swap
        finally:
            stop.set()
            reader.join()
        assert set(seen) == {8}, f"the reader saw {sorted(set(seen))} blocks of a 1000-block prompt"
        assert after.gid != before.gid and after.epoch == before.epoch + 1 == handle.registration.epoch
        assert await handle.indexed_blocks() == 40_000
        assert (await index.gc(unique_name, budget=100_000, grace_ms=0)).entries_removed == 40_000
        assert await index.match(unique_name, list(prompts[-1])) == {"a": 1000}
    finally:
        await client.aclose()


async def test_a_stage_never_swapped_counts_for_nobody_and_gc_collects_it_in_time(redis_client, unique_name):
    index = RedisIndex(redis_client)
    handle = await index.register(WorkerInfo("a", unique_name, "http://a", 16), LONG_TTL)
    prompt = chain(5, 20)
    await handle.store([StoredRun(None, prompt)])
    keys = index.keys(unique_name)
    staged = await stage_generation(index.scripts, keys, "a", handle.gid, 300)  # the writer dies after
    assert staged is not None
    bucket = keys.bucket_of_chain(prompt[0])
    kinds, blocks, args = encode_ops(handle.mirror.indexed_in_order())
    block_keys = [bucket.block(h) for h in blocks]
    await index.scripts.run(
        raw_call("claim", [keys.worker("a"), keys.gid_buckets(staged)], [staged, bucket_of(prompt[0])])
    )
    await index.scripts.run(
        raw_call("apply", [bucket.state(staged), bucket.log(staged), *block_keys], [staged, 0, 1, kinds, *args])
    )
    assert await redis_client.sismember(bucket.block(prompt[-1]), str(staged))
    assert await index.match(unique_name, list(prompt)) == {"a": 20}
    assert (await index.gc(unique_name, grace_ms=0)).entries_removed == 0  # not before its time

    async def collected() -> bool:
        return (await index.gc(unique_name, grace_ms=0)).entries_removed == 20

    await wait_until(collected, 5)
    assert not await redis_client.sismember(bucket.block(prompt[-1]), str(staged))
    assert await index.match(unique_name, list(prompt)) == {"a": 20}
    assert await redis_client.hget(keys.gids, str(staged)) is None


async def test_a_registration_during_a_reassert_voids_its_stage(redis_client, unique_name):
    index = RedisIndex(redis_client)
    handle = await index.register(WorkerInfo("a", unique_name, "http://a", 16), LONG_TTL)
    keys = index.keys(unique_name)
    staged = await stage_generation(index.scripts, keys, "a", handle.gid, LONG_TTL)
    current = (await RedisIndex(redis_client).register(WorkerInfo("a", unique_name, "http://a", 16))).gid
    assert await swap_generation(index.scripts, keys, "a", current, staged, LONG_TTL, 0) is None
    # The registration voided the stage: the staged gid can claim no bucket to write into.
    assert (
        await index.scripts.run(raw_call("claim", [keys.worker("a"), keys.gid_buckets(staged)], [staged, 1]))
        == "superseded"
    )
