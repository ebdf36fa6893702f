"""Behaviour only the Redis backend has: script reloads, restarts, argument checks, gc, relog."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis
from redis.crc import key_slot
from redis.exceptions import ConnectionError, ResponseError

from kvindex import calls as lua
from kvindex.errors import ScriptArgumentError, StaleGenerationError
from kvindex.hashing import sequence_hashes
from kvindex.keys import bucket_of
from kvindex.pages import pages_of
from kvindex.redis_index import RELOG_SLACK, RedisIndex
from kvindex.settings import RedisSettings
from kvindex.types import HeartbeatStatus, StoredRun, WorkerInfo, WorkerLoad
from kvroute.devstack.embedded_redis import RedisServer, available_servers
from tests.support import raw_call

LONG_TTL = 60_000
CHAIN = sequence_hashes(list(range(256)), 16)  # 16 blocks


def worker(model: str, name: str = "a") -> WorkerInfo:
    return WorkerInfo(name, model, f"http://{name}", 16)


async def model_keys(client: Redis, model: str) -> dict[bytes, bytes]:
    """Every key of the model with its DUMP, to prove a rejected call changed nothing."""
    out = {}
    for pattern in (f"kvr:{{{model}}}:*", f"kvr:{{{model}#*}}:*"):  # control and bucket keys
        async for key in client.scan_iter(match=pattern, count=1000):
            out[key] = await client.dump(key)
    return out


async def test_scripts_reload_after_script_flush(redis_client, unique_name):
    index = RedisIndex(redis_client)
    await index.register(worker(unique_name), LONG_TTL)
    await index.match(unique_name, CHAIN)
    loads_before = index.scripts.reloads
    await redis_client.script_flush()
    await index.handle(unique_name, "a").store([StoredRun(None, tuple(CHAIN[:5]))])
    await redis_client.script_flush()
    assert await index.match(unique_name, CHAIN) == {"a": 5}
    assert index.scripts.reloads - loads_before >= 2  # at least once after each flush


async def test_a_batch_interrupted_mid_reply_never_leaves_replies_for_the_next(redis_server, unique_name):
    """A routing decision times out while Redis is paused: its connection must not be reused with
    the old replies pending, or the next decision would read the previous one's answers."""
    client = Redis.from_url(redis_server.url, max_connections=1)
    admin = Redis.from_url(redis_server.url)
    index = RedisIndex(client)
    await index.register(worker(unique_name), LONG_TTL)
    await index.handle(unique_name, "a").store([StoredRun(None, tuple(CHAIN[:5]))])
    other = f"{unique_name}-other"
    await index.register(worker(other), LONG_TTL)
    await index.handle(other, "a").store([StoredRun(None, tuple(CHAIN[:2]))])
    await admin.execute_command("CLIENT", "PAUSE", 300, "ALL")
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await index.scripts.call_many(index.match_calls(unique_name, CHAIN))
    # Still paused: the interrupted reply will arrive first on that connection, if it is reused.
    replies = await index.scripts.call_many(index.match_calls(other, CHAIN))
    assert await index.match_result(other, CHAIN, replies) == {"a": 2}
    assert await index.match(unique_name, CHAIN) == {"a": 5}
    await client.aclose()
    await admin.aclose()


@pytest.mark.faults
@pytest.mark.parametrize("kind", sorted(available_servers()))
async def test_a_restarted_empty_redis_is_refilled_by_reassert(kind, unique_name):
    binary = available_servers()[kind]
    server = RedisServer(binary=binary).start()
    client = RedisSettings(url=server.url).client()
    try:
        index = RedisIndex(client)
        await index.register(worker(unique_name), LONG_TTL)
        await index.handle(unique_name, "a").store(
            [StoredRun(None, tuple(CHAIN[:9])), StoredRun(CHAIN[3], (CHAIN[0],))]
        )
        await index.handle(unique_name, "a").remove([CHAIN[8]])
        before = await index.match(unique_name, CHAIN)
        server.stop(kill=True)
        server = RedisServer(binary=binary, port=server.port).start()  # same port, empty, no scripts
        assert await index.handle(unique_name, "a").heartbeat(LONG_TTL) == HeartbeatStatus.MISSING
        await index.handle(unique_name, "a").reassert()
        assert await index.match(unique_name, CHAIN) == before == {"a": 8}
        assert index.scripts.reloads >= 1
        assert await index.handle(unique_name, "a").heartbeat(LONG_TTL) == HeartbeatStatus.OK
    finally:
        await client.aclose()
        server.stop()


@pytest.mark.parametrize(
    ("script", "args", "message"),
    [
        ("page_apply", ["{gid}", 1, 1, "x", 0, 1, 1, 1, "{first}", 0, 0, 0], "op ids"),
        ("page_apply", ["{gid}", 1, 1, 1, 0, 1, 1, 1, "{first}", 0, 0, 0], "op > previous op"),
        ("page_apply", ["{gid}", 1, 1, 99, 0, 1, 1, 1, "{first}", 0, 1, 0, "{first}", "00"], "branch"),
        ("page_apply", ["{gid}", 1, 1, 99, 0, 1, 1, 1, "{first}", 0, 0, 1, "xyz"], "16 hex digits"),
        ("page_apply", ["{gid}", 1, 1, 99, 0, 1, 1, 2, "{first}", 0, 0, 0], "key place"),
        ("page_apply", ["{gid}", 1, 1, 99, 0, 1, 1, 1, "{first}", 0, 0, 0, "extra"], "arguments malformed"),
        ("page_apply", ["{gid}", 0, 1, 99, 0, 1, 1, 1, "{first}", 0, 0, 0], "positive number of buckets"),
        ("page_match", ["1", "{first}", 2, "e:{first}", "h:{first}"], "malformed"),
        ("page_match", ["1", "{first}", "x", "e:{first}", "h:{first}"], "page count"),
        ("page_match", ["1", "{first}" * 33, 1, "e:{first}", "h:{first}"], "do not agree"),
        ("load", ["{gid}", -1, 0, "0.5"], "non-negative running"),
        ("load", ["{gid}", 1, 0, "1.5"], "within 0..1"),
        ("relog", ["{gid}", 1, 99, b"\0" * 9], "8 bytes per entry"),
    ],
)
async def test_malformed_script_arguments_are_rejected_without_changes(
    redis_client, unique_name, script, args, message
):
    index = RedisIndex(redis_client)
    registration = await index.register(worker(unique_name), LONG_TTL)
    await index.handle(unique_name, "a").store([StoredRun(None, tuple(CHAIN[:4]))])
    keys = index.keys(unique_name)
    bucket = keys.bucket_of_segment(CHAIN[0])
    gid = registration.gid
    key_lists = {
        "page_apply": [bucket.state(gid), bucket.page_log(gid), keys.segment(CHAIN[0])],
        "page_match": [keys.segment(CHAIN[0])],
        "load": [keys.worker("a")],
        "relog": [bucket.state(gid), bucket.page_log(gid)],
    }
    first = f"{CHAIN[0]:016x}"
    filled = [a.replace("{gid}", str(gid)).replace("{first}", first) if isinstance(a, str) else a for a in args]
    before = await model_keys(redis_client, unique_name)
    with pytest.raises(ResponseError, match=message):
        await index.scripts.call(raw_call(script, key_lists[script], filled))
    assert await model_keys(redis_client, unique_name) == before
    assert await index.match(unique_name, CHAIN) == {"a": 4}


async def test_bad_register_arguments_get_clear_errors(redis_client, unique_name):
    index = RedisIndex(redis_client)
    with pytest.raises(ScriptArgumentError, match="block_size must be a positive integer"):
        await index.register(WorkerInfo("a", unique_name, "http://a", 0), LONG_TTL)
    with pytest.raises(ScriptArgumentError, match="dp_rank"):
        await index.register(WorkerInfo("a", unique_name, "http://a", 16, dp_rank=-1), LONG_TTL)
    keys = index.keys(unique_name)
    with pytest.raises(ScriptArgumentError, match="role must be both, prefill or decode, got boss"):
        await index.scripts.run(lua.register(keys, "a", "http://a", 16, 0, LONG_TTL, 1 << 40, role="boss"))
    with pytest.raises(ScriptArgumentError, match="max_model_len must be a non-negative integer, got -5"):
        await index.scripts.run(lua.register(keys, "a", "http://a", 16, 0, LONG_TTL, 1 << 40, max_model_len=-5))
    with pytest.raises(ScriptArgumentError, match="engine_kind must be a short lower-case name, got V LLM"):
        await index.scripts.run(lua.register(keys, "a", "http://a", 16, 0, LONG_TTL, 1 << 40, engine_kind="V LLM"))
    assert await model_keys(redis_client, unique_name) == {}


async def test_a_second_registration_supersedes_the_first_writer(redis_client, unique_name):
    first, second = RedisIndex(redis_client), RedisIndex(redis_client)
    old = await first.register(worker(unique_name), LONG_TTL)
    new = await second.register(worker(unique_name), LONG_TTL)
    assert await old.heartbeat(LONG_TTL) == HeartbeatStatus.SUPERSEDED
    with pytest.raises(StaleGenerationError):
        await old.store([StoredRun(None, tuple(CHAIN[:2]))])
    await new.store([StoredRun(None, tuple(CHAIN[:3]))])
    assert await first.match(unique_name, CHAIN) == {"a": 3}


async def test_gc_removes_every_entry_of_retired_generations_in_bounded_steps(redis_client, unique_name):
    index = RedisIndex(redis_client)
    await index.register(worker(unique_name, "a"), LONG_TTL)
    await index.register(worker(unique_name, "b"), LONG_TTL)
    chains = [sequence_hashes([i] * 16 + list(range(16 * 300)), 16) for i in range(20)]  # 10 pages each
    for chain in chains:
        await index.handle(unique_name, "a").store([StoredRun(None, tuple(chain))])
        await index.handle(unique_name, "b").store([StoredRun(None, tuple(chain[:3]))])
    await index.handle(unique_name, "a").clear()
    await index.handle(unique_name, "b").heartbeat(0)
    steps = 0
    while True:
        result = await index.gc(unique_name, budget=30, grace_ms=0)
        assert result.entries_removed <= 30
        steps += 1
        if result.gids_pending == 0:
            break
    assert steps > 5
    keys = await model_keys(redis_client, unique_name)
    leftovers = [k for k in keys if any(kind in k for kind in (b":s:", b":pl:", b":b:", b":log:"))]
    assert leftovers == []
    stats = await index.stats(unique_name)
    assert (stats.workers, stats.entries, stats.pages, stats.gids_pending_gc) == (1, 0, 0, 0)


async def test_churn_compacts_the_page_log_and_gc_still_finds_everything(redis_client, unique_name):
    index = RedisIndex(redis_client)
    registration = await index.register(worker(unique_name), LONG_TTL)
    chain = sequence_hashes(list(range(16 * 64)), 16)  # pages 0 and 1, two segment keys
    for _ in range(RELOG_SLACK + 20):  # evict the whole prompt and store it again, as a busy LRU cache does
        await index.handle(unique_name, "a").store([StoredRun(None, tuple(chain))])
        await index.handle(unique_name, "a").remove(chain[32:][::-1])
        await index.handle(unique_name, "a").remove(chain[:32][::-1])
    await index.handle(unique_name, "a").store([StoredRun(None, tuple(chain[:40]))])
    keys = index.keys(unique_name)
    for first in (chain[0], chain[32]):
        log_key = keys.bucket_of_segment(first).page_log(registration.gid)
        assert 1 <= await redis_client.strlen(log_key) // 32 <= 2 * 1 + RELOG_SLACK  # one page held there
    assert await index.match(unique_name, chain) == {"a": 40}
    await index.handle(unique_name, "a").clear()
    while (await index.gc(unique_name, budget=1000, grace_ms=0)).gids_pending:
        pass
    assert [k for k in await model_keys(redis_client, unique_name) if b":b:" in k] == []


async def test_a_models_control_keys_share_a_slot_and_each_segment_lives_in_its_buckets_slot(redis_client, unique_name):
    index = RedisIndex(redis_client)
    await index.register(worker(unique_name), LONG_TTL)
    chains = [sequence_hashes([seed] * 16 + list(range(16 * 70)), 16) for seed in range(20)]  # pages 0-2
    for chain in chains:
        await index.handle(unique_name, "a").store([StoredRun(None, tuple(chain))])
    await index.handle(unique_name, "a").clear()
    keys = await model_keys(redis_client, unique_name)
    control = {k for k in keys if k.startswith(f"kvr:{{{unique_name}}}:".encode())}
    assert len(control) >= 5 and {key_slot(k) for k in control} == {key_slot(unique_name.encode())}
    for chain in chains:
        for page in pages_of(chain):
            bucket = index.keys(unique_name).bucket_of_segment(page.segment)
            mine = {k for k in keys if k.startswith(bucket.base.encode())}
            assert bucket.segment(page.segment).encode() in mine  # the segment, in its bucket's slot
            assert len({key_slot(k) for k in mine}) == 1
    slots = {key_slot(k) for k in set(keys) - control}
    assert len(slots) >= 10  # 20 roots: the model spreads over many slots (and a cluster's masters)


@pytest.mark.faults
async def test_writes_while_redis_is_down_reach_it_through_reassert(unique_name):
    server = RedisServer(binary=available_servers()["redis"]).start()
    client = RedisSettings(url=server.url, socket_timeout_s=0.5).client()
    try:
        index = RedisIndex(client)
        handle = await index.register(worker(unique_name), LONG_TTL)
        await handle.store([StoredRun(None, tuple(CHAIN[:4]))])
        server.stop(kill=True)
        with pytest.raises(ConnectionError):
            await handle.store([StoredRun(CHAIN[3], tuple(CHAIN[4:6]))])
        assert handle.needs_reassert() and index.handle(unique_name, "a").needs_reassert()
        # While dirty, writes only update the mirror (no waiting on a dead server).
        await handle.remove([CHAIN[5]])
        await handle.store([StoredRun(CHAIN[4], tuple(CHAIN[5:8]))])
        server = RedisServer(binary=server.binary, port=server.port).start()
        await handle.reassert()
        assert not handle.needs_reassert()
        assert await index.match(unique_name, CHAIN) == {"a": 8}
    finally:
        await client.aclose()
        server.stop()


async def test_reassert_renews_the_same_handle_in_place(redis_client, unique_name):
    index = RedisIndex(redis_client)
    handle = await index.register(worker(unique_name), LONG_TTL)
    await handle.store([StoredRun(None, tuple(CHAIN[:6]))])
    await handle.report_load(WorkerLoad(1, 2, 0.5))
    before = handle.registration
    bucket = bucket_of(CHAIN[0])
    assert handle.writes.ops == {bucket: 1} and await handle.indexed_blocks() == 6 == handle.mirror.indexed_count
    await redis_client.delete(index.keys(unique_name).segment(CHAIN[0]))  # drift: Redis lost the holdings
    assert await handle.indexed_blocks() == 6  # the bucket's count does not know
    after = await handle.reassert()
    assert handle.registration == after and after.gid != before.gid and after.epoch == before.epoch + 1
    assert handle.writes.ops == {bucket: 1}  # one page_apply: op ids start again with the generation
    assert index.handle(unique_name, "a") is handle and handle.active
    assert await index.match(unique_name, CHAIN) == {"a": 6}
    assert (await index.workers(unique_name))[0].load == WorkerLoad(1, 2, 0.5)
    assert await handle.indexed_blocks() == 6


async def test_a_handle_superseded_by_another_client_is_refused_by_redis(redis_client, unique_name):
    mine = await RedisIndex(redis_client).register(worker(unique_name), LONG_TTL)
    theirs = await RedisIndex(redis_client).register(worker(unique_name), LONG_TTL)
    assert mine.active  # only Redis knows
    assert await mine.heartbeat() == HeartbeatStatus.SUPERSEDED
    assert await mine.indexed_blocks() is None
    with pytest.raises(StaleGenerationError):
        await mine.clear()
    await theirs.store([StoredRun(None, tuple(CHAIN[:2]))])
    assert await theirs.indexed_blocks() == 2


async def test_a_load_report_carries_the_engines_cache_size(redis_client, unique_name):
    index = RedisIndex(redis_client)
    handle = await index.register(worker(unique_name), LONG_TTL)
    await handle.report_load(WorkerLoad(1, 0, 0.25))
    assert (await index.workers(unique_name))[0].load == WorkerLoad(1, 0, 0.25, capacity_blocks=None)
    await handle.report_load(WorkerLoad(2, 1, 0.5, capacity_blocks=4096))
    assert (await index.workers(unique_name))[0].load == WorkerLoad(2, 1, 0.5, capacity_blocks=4096)
    keys = index.keys(unique_name)
    with pytest.raises(ResponseError, match="capacity must be a positive integer"):
        await index.scripts.call(raw_call("load", [keys.worker("a")], [handle.gid, 1, 0, "0.5", "1.5"]))
