"""What readers can see of a worker's writes: on a single Redis a write's pages in every bucket
go in one page_apply.lua call (all of it or none of it), and a re-assert never shows the worker
emptier than its old generation."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Awaitable, Callable

from redis.asyncio import Redis

from kvindex import calls as lua
from kvindex import redis_worker
from kvindex.calls import BucketPages
from kvindex.generations import stage_generation, swap_generation
from kvindex.pages import holding_changes, page_holdings, pages_of
from kvindex.redis_index import RedisIndex
from kvindex.types import RemovedBlocks, StoredRun, WorkerInfo
from tests.support import raw_call, wait_until

LONG_TTL = 600_000


def chain(seed: int, length: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.getrandbits(64) for _ in range(length))


async def applied_calls(client, index: RedisIndex, model: str, handle, prompt: tuple[int, ...]) -> set[int]:
    """The op ids of the gid's states in the buckets of ``prompt``'s segments: one per
    page_apply.lua part each bucket received for this generation."""
    keys = index.keys(model)
    states = {keys.bucket_of_segment(page.segment).state(handle.gid) for page in pages_of(prompt)}
    return {int(await client.hget(state, "op") or 0) for state in states}


async def test_a_write_of_thousands_of_blocks_is_one_page_apply_call(redis_client, unique_name):
    index = RedisIndex(redis_client)
    handle = await index.register(WorkerInfo("a", unique_name, "http://a", 16), LONG_TTL)
    stored = chain(1, 5000)  # 157 pages in 9 segment keys
    evicted = chain(2, 1000)
    await handle.store([StoredRun(None, evicted)])
    await redis_client.config_resetstat()
    await handle.apply([StoredRun(None, stored), RemovedBlocks(evicted[::-1])])
    stats = await redis_client.info("commandstats")
    assert stats["cmdstat_evalsha"]["calls"] == 3  # claim.lua (new buckets), page_apply.lua for all, tally.lua
    assert await applied_calls(redis_client, index, unique_name, handle, stored) == {1}
    assert await applied_calls(redis_client, index, unique_name, handle, evicted) == {2}
    assert await index.match(unique_name, list(stored)) == {"a": 5000}
    assert await index.match(unique_name, list(evicted)) == {"a": 0}


async def test_only_a_write_of_more_pages_than_a_call_carries_is_split(redis_client, unique_name, monkeypatch):
    monkeypatch.setattr(redis_worker, "MAX_PAGES_PER_CALL", 4)
    index = RedisIndex(redis_client)
    handle = await index.register(WorkerInfo("a", unique_name, "http://a", 16), LONG_TTL)
    small = chain(0, 32 * 4)  # pages 0, 1, 2-3: no bucket has more than 4
    await handle.store([StoredRun(None, small)])
    assert handle.split_batches == 0
    big = chain(9, 32 * 20)  # segment 8-15 has 8 pages in one bucket: two parts
    await handle.store([StoredRun(None, big)])
    assert handle.split_batches == 1
    assert await applied_calls(redis_client, index, unique_name, handle, big) == {1, 2}
    assert await index.match(unique_name, list(big)) == {"a": 640}
    assert (await index.stats(unique_name)).entries == 128 + 640


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
        prompts = [chain(seed, 1000) for seed in range(40)]  # 40,000 blocks, 1,280 pages: two calls
        await handle.apply_batches([[StoredRun(None, p)] for p in prompts])
        # The prompts whose first segment the refill writes last (segments go in order).
        last = sorted(prompts, key=lambda p: p[0])[-3:]
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
        assert (await index.gc(unique_name, budget=100_000, grace_ms=0)).entries_removed == 40 * 32  # holdings
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
    bucket = keys.bucket_of_segment(prompt[0])
    await index.scripts.run(raw_call("claim", [keys.worker("a"), keys.gid_buckets(staged)], [staged, bucket.number]))
    changes = holding_changes({}, page_holdings([prompt]))
    await index.scripts.run(lua.page_apply(staged, [BucketPages(bucket, 0, 1, len(prompt), changes)]))
    leaf = f"e:{prompt[-1]:016x}"
    assert str(staged).encode() in await redis_client.hget(keys.segment(prompt[0]), leaf)
    assert await index.match(unique_name, list(prompt)) == {"a": 20}
    assert (await index.gc(unique_name, grace_ms=0)).entries_removed == 0  # not before its time

    async def collected() -> bool:
        return (await index.gc(unique_name, grace_ms=0)).entries_removed == 1  # its one holding

    await wait_until(collected, 5)
    assert str(staged).encode() not in await redis_client.hget(keys.segment(prompt[0]), leaf)
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
