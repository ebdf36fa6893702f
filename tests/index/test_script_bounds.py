"""Every Lua script's cost is bounded by its arguments, not by how much data piled up: each
script whose loops could run over data has a bound, and each bound is tested here (gc's budget
for retired gids is in test_gc.py)."""

from __future__ import annotations

import pytest

from kvindex.errors import BlockSizeMismatchError
from kvindex.redis_index import RedisIndex
from kvindex.types import WorkerInfo
from tests.support import raw_call, wait_until

LONG_TTL = 60_000


async def lease(index: RedisIndex, model: str, replica: str, *pairs: str | int) -> list:
    keys = index.keys(model)
    return await index.scripts.call(
        raw_call("lease", [keys.replicas, keys.inflight(replica)], [replica, LONG_TTL, LONG_TTL, *pairs])
    )


async def inflight_totals(index: RedisIndex, model: str, replicas: list[str]) -> dict[str, float]:
    keys = index.keys(model)
    flat = await index.scripts.call(
        raw_call("inflight", [keys.replicas, *(keys.inflight(r) for r in replicas)], replicas)
    )
    return {flat[i].decode(): float(flat[i + 1]) for i in range(0, len(flat), 2)}


async def test_inflight_sums_the_64_most_recent_replicas(redis_client, unique_name):
    index = RedisIndex(redis_client)
    for i in range(70):
        _, *live = await lease(index, unique_name, f"replica-{i}", "r:w", 1)
    assert len(live) == 64  # lease.lua names the 64 most recently renewed
    everyone = [f"replica-{i}" for i in range(70)]
    assert await inflight_totals(index, unique_name, everyone) == {"r:w": 64.0}


async def test_inflight_skips_a_replica_hash_too_large_to_sum(redis_client, unique_name):
    index = RedisIndex(redis_client)
    await lease(index, unique_name, "sane", "r:w", 2)
    await lease(index, unique_name, "garbage")
    garbage = {f"r:x{i}": 1 for i in range(20_000)}
    await redis_client.hset(index.keys(unique_name).inflight("garbage"), mapping=garbage)
    assert await inflight_totals(index, unique_name, ["sane", "garbage"]) == {"r:w": 2.0}


async def test_gc_retires_at_most_budget_dead_workers_per_call(redis_client, unique_name):
    index = RedisIndex(redis_client)
    for i in range(30):
        handle = await index.register(WorkerInfo(f"w{i}", unique_name, f"http://w{i}", 16), LONG_TTL)
        await handle.heartbeat(0)
    retired = [(await index.gc(unique_name, budget=10, grace_ms=0)).workers_retired for _ in range(4)]
    assert retired == [10, 10, 10, 0]


async def test_a_block_size_mismatch_among_many_alive_workers_names_one_of_them(redis_client, unique_name):
    """register.lua reads two alive gids at most to find another alive worker (one may be the
    registering worker's own previous generation), not the whole fleet."""
    index = RedisIndex(redis_client)
    for i in range(50):
        await index.register(WorkerInfo(f"w{i}", unique_name, f"http://w{i}", 16), LONG_TTL)
    with pytest.raises(BlockSizeMismatchError, match=r"by alive worker w\d+, worker w0 announced 32"):
        await index.register(WorkerInfo("w0", unique_name, "http://w0", 32), LONG_TTL)


async def lazyfreed(client) -> int:
    return int((await client.info("memory")).get("lazyfreed_objects", 0))


async def test_lease_frees_its_old_snapshot_outside_the_script_and_a_dead_replicas_hash_expires(
    redis_client, unique_name
):
    """A replica's old snapshot is deleted with UNLINK (freed by a background thread), so its
    size costs lease.lua nothing; an expired replica's hash is no script's to touch: it expires."""
    index = RedisIndex(redis_client)
    keys = index.keys(unique_name)
    await lease(index, unique_name, "big")
    await redis_client.hset(keys.inflight("big"), mapping={f"r:x{i}": 1 for i in range(1000)})
    before = await lazyfreed(redis_client)
    await lease(index, unique_name, "big", "r:w", 1)  # the rewrite drops the 1000 fields
    await redis_client.hset(keys.inflight("big"), mapping={f"r:x{i}": 1 for i in range(1000)})
    await redis_client.zadd(keys.replicas, {"big": 1})  # its lease ran out long ago
    forgotten, *live = await lease(index, unique_name, "other")  # forgets expired replicas
    assert forgotten == 1 and live == [b"other"]
    assert 0 < await redis_client.pttl(keys.inflight("big")) <= LONG_TTL
    assert await inflight_totals(index, unique_name, ["big", "other"]) == {}

    async def freed() -> bool:  # counted by the background thread once it has freed the hash
        return await lazyfreed(redis_client) > before

    await wait_until(freed, 10)
    assert await lazyfreed(redis_client) - before == 1
