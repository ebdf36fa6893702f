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
    bucket = keys.bucket_of_segment(CHAIN[0])
    await redis_client.hset(bucket.state(shortened), "c", 8000)
    await redis_client.hset(bucket.state(lost), "c", 24)
    await redis_client.delete(bucket.page_log(lost))  # the log is gone, its cursor is not
    result = await index.gc(unique_name, budget=1000, grace_ms=0)
    assert (result.entries_removed, result.gids_finished, result.gids_pending) == (1, 2, 0)  # a's one holding
    # b's holding cannot be found without its log: it stays, counted for nobody.
    page = await redis_client.hgetall(keys.segment(CHAIN[0]))
    assert page[f"e:{CHAIN[3]:016x}".encode()] == f",{lost},".encode()
    assert not any(str(shortened).encode() in k + v for k, v in page.items())
    for gid in (shortened, lost):  # each state is a tombstone that page_apply.lua refuses, and expires
        assert await redis_client.hgetall(bucket.state(gid)) == {b"dead": b"1"}
        assert await redis_client.pttl(bucket.state(gid)) > 0
    assert await index.match(unique_name, CHAIN) == {"a": 0, "b": 0}


async def test_gc_collects_a_generation_written_by_the_layout_before_pages(redis_client, unique_name):
    """An index being upgraded: a gid's block keys, block log and claims as the layout before
    pages wrote them (one SET per block, 8-byte hashes in the log). The upgraded agent registers
    its worker afresh, which retires the old gid; it writes pages, and gc collects the old keys."""
    index = RedisIndex(redis_client)
    keys = index.keys(unique_name)
    gid = (await index.register(worker(unique_name, "old"), LONG_TTL)).gid
    bucket = keys.bucket_of_chain(CHAIN[0])
    for block in CHAIN:
        await redis_client.sadd(bucket.block(block), gid)
    await redis_client.sadd(bucket.block(CHAIN[0]), 7)  # another gid's entry stays
    await redis_client.set(bucket.log(gid), b"".join(h.to_bytes(8, "big") for h in CHAIN))
    await redis_client.hset(bucket.state(gid), mapping={"op": 1, "n": len(CHAIN)})
    await redis_client.sadd(keys.gid_buckets(gid), bucket.number)
    await redis_client.hset(keys.gids, str(gid), "old")
    await redis_client.hset(keys.meta, "block_keys", len(CHAIN))
    upgraded = RedisIndex(redis_client)  # the new agent: a registration of its own, pages
    await upgraded.register(worker(unique_name, "old"), LONG_TTL)
    await upgraded.handle(unique_name, "old").store([StoredRun(None, tuple(CHAIN[:6]))])
    assert await upgraded.match(unique_name, CHAIN) == {"old": 6}  # its pages; the old gid is retired
    result = await index.gc(unique_name, budget=1000, grace_ms=0)
    assert result.entries_removed >= len(CHAIN)
    assert [k for k in await model_keys(redis_client, unique_name) if b":b:" in k] == [bucket.block(CHAIN[0]).encode()]
    assert await redis_client.smembers(bucket.block(CHAIN[0])) == {b"7"}
    assert await redis_client.hgetall(bucket.state(gid)) == {b"dead": b"1"}
    assert (await index.stats(unique_name)).block_keys == 1
    assert await upgraded.match(unique_name, CHAIN) == {"old": 6}


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
