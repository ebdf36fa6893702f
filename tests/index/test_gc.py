"""gc's bounds (kvindex.collector): a call does at most `budget` units of work whatever waits, and a retired gid
whose cursor outlived its log is still collected (it stopped gc for the whole model)."""

from __future__ import annotations

from kvindex.hashing import sequence_hashes
from kvindex.redis_index import RedisIndex
from kvindex.types import StoredRun, WorkerInfo
from tests.index.test_redis_only import model_keys

LONG_TTL = 60_000
CHAIN = sequence_hashes(list(range(160)), 16)  # 10 blocks


def worker(model: str, name: str) -> WorkerInfo:
    return WorkerInfo(name, model, f"http://{name}", 16)


async def block_keys_left(client, model: str) -> list[bytes]:
    return [k for k in await model_keys(client, model) if b":b:" in k]


async def test_a_cursor_beyond_its_log_counts_from_the_logs_end(redis_client, unique_name):
    index = RedisIndex(redis_client)
    keys = index.keys(unique_name)
    a = await index.register(worker(unique_name, "a"), LONG_TTL)
    b = await index.register(worker(unique_name, "b"), LONG_TTL)
    await a.store([StoredRun(None, tuple(CHAIN))])
    await b.store([StoredRun(None, tuple(CHAIN[:4]))])
    shortened, lost = a.gid, b.gid
    await a.clear()
    await b.clear()
    bucket = keys.bucket_of_chain(CHAIN[0])
    await redis_client.hset(bucket.state(shortened), "c", 8000)
    await redis_client.hset(bucket.state(lost), "c", 24)
    await redis_client.delete(bucket.log(lost))  # the log is gone, its cursor is not
    result = await index.gc(unique_name, budget=1000, grace_ms=0)
    assert (result.entries_removed, result.gids_finished, result.gids_pending) == (10, 2, 0)
    # b's entries cannot be found without its log: they stay, counted for nobody.
    assert sorted(await block_keys_left(redis_client, unique_name)) == sorted(
        bucket.block(h).encode() for h in CHAIN[:4]
    )
    for gid in (shortened, lost):  # each state is a tombstone that apply.lua refuses, and expires
        assert await redis_client.hgetall(bucket.state(gid)) == {b"dead": b"1"}
        assert await redis_client.pttl(bucket.state(gid)) > 0
    assert await index.match(unique_name, CHAIN) == {"a": 0, "b": 0}


async def test_retired_gids_without_blocks_count_toward_the_budget(redis_client, unique_name):
    index = RedisIndex(redis_client)
    a = await index.register(worker(unique_name, "a"), LONG_TTL)
    for _ in range(300):  # an agent that clears an empty worker over and over
        await a.clear()
    calls = 0
    while True:
        result = await index.gc(unique_name, budget=50, grace_ms=0)
        calls += 1
        assert result.gids_finished <= 50
        if result.gids_pending == 0:
            break
    assert calls == 6
    assert await redis_client.hlen(index.keys(unique_name).gids) == 1  # the current gid only
