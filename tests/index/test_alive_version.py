"""The alive set's version (alive_since.lua, kvindex.alive_cache): a reader's copy is confirmed
by its version alone (a GET) while nobody joined, left or lost time, by the script near its
refresh time, and every change reaches the next match."""

from __future__ import annotations

import time

import pytest
from redis.exceptions import ResponseError

from kvindex import calls as lua
from kvindex.alive_cache import MAX_AGE_MS, AliveCache
from kvindex.hashing import sequence_hashes
from kvindex.redis_index import RedisIndex
from kvindex.types import StoredRun, WorkerInfo

LONG_TTL = 60_000
CHAIN = sequence_hashes(list(range(128)), 16)  # 8 blocks


def worker(model: str, name: str) -> WorkerInfo:
    return WorkerInfo(name, model, f"http://{name}", 16)


async def version(client, model: str) -> bytes | None:
    return await client.get(RedisIndex(client).keys(model).alive_version)


async def test_only_changes_to_who_is_alive_write_a_new_version(redis_client, unique_name):
    index = RedisIndex(redis_client)
    handle = await index.register(worker(unique_name, "a"), LONG_TTL)
    seen = [await version(redis_client, unique_name)]
    assert seen[0] is not None

    async def changed() -> bool:
        now = await version(redis_client, unique_name)
        fresh = now not in seen
        seen.append(now)
        return fresh

    await handle.heartbeat(LONG_TTL)  # a live deadline pushed later
    assert not await changed()
    await handle.heartbeat(0)  # lowered: not alive at once
    assert await changed()
    await handle.heartbeat(LONG_TTL)  # a lapsed gid revived
    assert await changed()
    await index.register(worker(unique_name, "b"), LONG_TTL)
    assert await changed()
    await handle.clear()
    assert await changed()
    await handle.reassert()  # stage, fill, swap
    assert await changed()
    await handle.deregister()
    assert await changed()
    assert len(set(seen)) == len(seen) - 1  # versions never repeat


async def test_a_copy_is_confirmed_by_its_version_until_it_no_longer_holds(redis_client, unique_name):
    index = RedisIndex(redis_client)
    keys = index.keys(unique_name)
    handles = [await index.register(worker(unique_name, f"w{i}"), LONG_TTL) for i in range(50)]
    cache = AliveCache()
    first = await index.scripts.run(cache.call(keys))
    assert len(first) == 4 and first[3] and len(cache.alive(unique_name, first) or ()) == 50
    await handles[0].heartbeat(LONG_TTL)
    confirm = cache.call(keys)
    assert confirm.spec is lua.ALIVE_VERSION  # a GET, not a script
    assert cache.alive(unique_name, await index.scripts.run(confirm)) == {h.gid for h in handles}
    await handles[1].heartbeat(0)
    assert cache.alive(unique_name, await index.scripts.run(cache.call(keys))) is None  # another version
    after = await index.scripts.run(cache.whole_call(keys))
    assert cache.alive(unique_name, after) == {h.gid for h in handles[2:]} | {handles[0].gid}


async def test_near_its_refresh_time_a_copy_is_confirmed_by_the_script(redis_client, unique_name):
    index = RedisIndex(redis_client)
    keys = index.keys(unique_name)
    await index.register(worker(unique_name, "a"), LONG_TTL)
    skew = [0.0]
    cache = AliveCache(lambda: time.monotonic() + skew[0])
    cache.alive(unique_name, await index.scripts.run(cache.call(keys)))
    skew[0] = MAX_AGE_MS / 1000  # this reader's bound of the server's clock is past the copy's refresh
    call = cache.call(keys)
    assert call.spec is lua.ALIVE_SINCE
    reply = await index.scripts.run(call)  # the server's own clock: the copy still holds
    assert reply[3] is None and len(cache.alive(unique_name, reply) or ()) == 1
    # A version's reply read past the bound is not trusted: read again.
    version_reply = await index.scripts.run(lua.alive_version(keys))
    skew[0] = 10 * MAX_AGE_MS / 1000
    assert cache.alive(unique_name, version_reply) is None


async def test_a_lost_version_key_makes_readers_read_the_whole_set(redis_client, unique_name):
    index = RedisIndex(redis_client)
    keys = index.keys(unique_name)
    await index.register(worker(unique_name, "a"), LONG_TTL)
    cache = AliveCache()
    cache.alive(unique_name, await index.scripts.run(cache.call(keys)))
    await redis_client.delete(keys.alive_version)
    assert cache.alive(unique_name, await index.scripts.run(cache.call(keys))) is None
    reply = await index.scripts.run(cache.whole_call(keys))
    assert len(cache.alive(unique_name, reply) or ()) == 1


async def test_every_change_reaches_another_clients_next_match(redis_client, unique_name):
    writer, reader = RedisIndex(redis_client), RedisIndex(redis_client)
    a = await writer.register(worker(unique_name, "a"), LONG_TTL)
    await a.store([StoredRun(None, tuple(CHAIN[:4]))])
    assert await reader.match(unique_name, CHAIN) == {"a": 4}
    assert await reader.match(unique_name, CHAIN) == {"a": 4}  # confirmed, not read again
    b = await writer.register(worker(unique_name, "b"), LONG_TTL)
    await b.store([StoredRun(None, tuple(CHAIN[:6]))])
    assert await reader.match(unique_name, CHAIN) == {"a": 4, "b": 6}
    await a.heartbeat(0)
    assert await reader.match(unique_name, CHAIN) == {"b": 6}
    await a.heartbeat(LONG_TTL)
    assert await reader.match(unique_name, CHAIN) == {"a": 4, "b": 6}
    await b.reassert()
    assert await reader.match(unique_name, CHAIN) == {"a": 4, "b": 6}
    await b.clear()
    assert await reader.match(unique_name, CHAIN) == {"a": 4, "b": 0}
    await a.deregister()
    assert await reader.owners(unique_name, CHAIN[0], CHAIN[:1]) == {}


async def test_alive_since_refuses_a_refresh_time_that_is_not_a_number(redis_client, unique_name):
    index = RedisIndex(redis_client)
    with pytest.raises(ResponseError, match="refresh time must be a number of ms, got soon"):
        await index.scripts.call(lua.alive_since(index.keys(unique_name), "", "soon"))  # type: ignore[arg-type]
