"""The worker agent as a process, between a real ZMQ publisher (+ engine HTTP) and a real Redis:
the event stream, its faults, and the index it keeps."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from kvindex.hashing import sequence_hashes
from kvindex.redis_index import RedisIndex
from kvindex.settings import RedisSettings
from kvindex.tiers import tier_holder
from kvindex.types import WorkerLoad
from kvroute.devstack.embedded_redis import RedisServer, available_servers, free_port
from sim_engine.kv_events import cleared_event, stored_event
from tests.conftest import server_kinds
from tests.support import AgentProcess, EngineStandIn, wait_until
from tests.support.agent import BS, CHAIN, agent_args, registered, removed, stored, wait_for_match


@pytest.fixture
async def agent(engine: EngineStandIn, server: RedisServer) -> AsyncIterator[AgentProcess]:
    process = AgentProcess([*agent_args(engine, server.url), "--verify-interval", "0.2"]).start()
    yield process
    process.kill()
    if process.process is not None and process.process.returncode not in (0, -9):
        print(process.log())


async def test_stores_and_removals_reach_the_index_in_our_hashing(engine, agent, index, unique_name):
    pub = engine.publisher
    await pub.publish([stored(0, 6)])
    await wait_for_match(index, unique_name, [6])
    await pub.publish([stored(6, 8), removed(7)])  # one batch: stored then removed
    await pub.publish([stored(6, 7)])  # a second copy of block 6
    await wait_for_match(index, unique_name, [7])
    await pub.publish([removed(6)])
    await wait_for_match(index, unique_name, [7])  # one copy left
    await pub.publish([removed(6)])
    await wait_for_match(index, unique_name, [6])
    (record,) = await index.workers(unique_name)
    assert (record.worker_id, record.url, record.block_size) == (f"{engine.url}#0", engine.url, BS)
    checks = await agent.metric("kvroute_agent_verifications_total")

    async def checked_again() -> bool:  # block-count checks (every 0.2 s here) pass without a re-assert
        return await agent.metric("kvroute_agent_verifications_total") >= checks + 2

    await wait_until(checked_again, 10)
    metrics = await agent.metrics()
    assert not [k for k in metrics if k.startswith("kvroute_agent_reasserts_total")], metrics
    assert metrics["kvroute_agent_batches_applied_total"] == 5
    assert metrics["kvroute_agent_gaps_total"] == 0
    assert metrics["kvroute_agent_mirror_indexed_blocks"] == 6
    status, body = await agent.health()
    assert status == 200 and body["registered"] is True


async def test_the_engine_load_is_scraped_into_the_index(engine, agent, index, unique_name):
    engine.load = (3, 2, 0.5)

    async def loaded() -> bool:
        records = await index.workers(unique_name)
        return bool(records) and records[0].load == WorkerLoad(3, 2, 0.5)

    await wait_until(loaded, 10)
    engine.load = (1, 0, 0.25)

    async def updated() -> bool:
        return (await index.workers(unique_name))[0].load == WorkerLoad(1, 0, 0.25)

    assert await wait_until(updated, 5) < 2.0


async def test_sigterm_deregisters_at_once(engine, agent, index, unique_name):
    await engine.publisher.publish([stored(0, 4)])
    await wait_for_match(index, unique_name, [4])
    assert agent.terminate() == 0
    assert await index.match(unique_name, CHAIN) == {}


async def test_an_agent_started_late_rebuilds_from_the_replay_buffer(engine, server, index, unique_name):
    pub = engine.publisher
    await pub.publish([stored(0, 8)])
    await pub.publish([removed(7, 6)])
    await pub.publish([stored(6, 10)])
    process = AgentProcess(agent_args(engine, server.url)).start()
    try:
        await wait_for_match(index, unique_name, [10])
        assert await process.metric("kvroute_agent_resyncs_total") == 0
    finally:
        process.kill()


@pytest.mark.faults
async def test_an_agent_killed_mid_stream_converges_after_restart(engine, server, index, unique_name):
    pub = engine.publisher
    first = AgentProcess(agent_args(engine, server.url)).start()
    await pub.publish([stored(0, 5)])
    await wait_for_match(index, unique_name, [5])
    first.kill()
    await pub.publish([removed(4, 3)])
    await pub.publish([stored(3, 12)])
    second = AgentProcess(agent_args(engine, server.url)).start()
    try:
        await wait_for_match(index, unique_name, [12])
        await pub.publish([removed(11)])
        await wait_for_match(index, unique_name, [11])
        assert (await index.workers(unique_name))[0].blocks == 11
    finally:
        second.kill()


@pytest.mark.faults
async def test_dropped_frames_are_repaired_by_replay(engine, agent, index, unique_name):
    pub = engine.publisher
    await pub.publish([stored(0, 8)])
    await wait_for_match(index, unique_name, [8])
    await pub.publish([removed(7, 6, 5)], deliver=False)  # lost on the way
    await pub.publish([stored(5, 6)], deliver=False)
    await pub.publish([stored(6, 7)])  # the next one arrives: the gap shows
    await wait_for_match(index, unique_name, [7])
    metrics = await agent.metrics()
    assert metrics["kvroute_agent_gaps_total"] == 1
    assert metrics["kvroute_agent_replays_total"] == 2  # start-up catch-up + the gap
    assert metrics["kvroute_agent_resyncs_total"] == 0


@pytest.mark.faults
async def test_a_gap_without_replay_clears_and_rebuilds(unique_name, server, index):
    engine = await EngineStandIn(model=unique_name, block_size=BS).start(replay=False)
    process = AgentProcess(agent_args(engine, server.url, replay=False)).start()
    try:
        pub = engine.publisher
        await wait_until(lambda: registered(index, unique_name), 10)
        await pub.publish([stored(0, 8)])
        await wait_for_match(index, unique_name, [8])
        await pub.publish([removed(7, 6, 5, 4)], deliver=False)
        await pub.publish([stored(0, 2)])  # a duplicate store of the first blocks, after the gap
        # The removals are lost for good: the agent must not keep claiming blocks 4..7.
        await wait_for_match(index, unique_name, [2])
        assert await process.metric("kvroute_agent_resyncs_total") == 1
    finally:
        process.kill()
        await engine.stop()


@pytest.mark.faults
async def test_garbage_frames_are_counted_and_skipped(engine, agent, index, unique_name):
    pub = engine.publisher
    await wait_until(lambda: registered(index, unique_name), 10)
    garbage = [
        [b"kv", b"\x00" * 8, b"\xc1\xc1 not msgpack"],
        [b"kv", b"short", b"\x93\x00\x90\x00"],
        [b"kv"],
        [b"kv", (0).to_bytes(8, "big"), b"\x92\x01\x91\x81\xa4type\xabBlockStored"],  # no hashes
    ]
    for frames in garbage:
        await pub.send_raw(frames)
    await pub.publish([stored(0, 3)])
    await wait_for_match(index, unique_name, [3])
    assert await agent.metric("kvroute_agent_decode_errors_total") == len(garbage)
    assert agent.process.poll() is None


@pytest.mark.faults
async def test_an_engine_restart_empties_the_worker(engine, agent, index, unique_name):
    pub = engine.publisher
    await pub.publish([stored(0, 9)])
    await wait_for_match(index, unique_name, [9])
    pub.restart()  # seq back to 0: a new process with an empty cache
    await pub.publish([stored(0, 2)])
    await wait_for_match(index, unique_name, [2])
    assert await agent.metric("kvroute_agent_engine_restarts_total") == 1


@pytest.mark.faults
async def test_an_engine_down_leaves_routing_and_a_new_process_comes_back_empty(engine, server, index, unique_name):
    engine.start_time = 1_000.0
    process = AgentProcess([*agent_args(engine, server.url), "--ttl-ms", "2000"]).start()
    try:
        pub = engine.publisher
        await pub.publish([stored(0, 5)])
        await wait_for_match(index, unique_name, [5])
        engine.healthy = False  # heartbeats pause: the worker leaves routing when its TTL runs out
        await wait_for_match(index, unique_name, [], within=15)
        status, body = await process.health()
        assert status == 503 and body["engine_up"] is False and body["status"] == "engine_down"
        pub.restart()
        engine.start_time = 2_000.0  # the evidence that this is a new process, with an empty cache
        engine.healthy = True
        await wait_for_match(index, unique_name, [0], within=10)
        await pub.publish([stored(0, 3)])
        await wait_for_match(index, unique_name, [3])
        assert await process.metric("kvroute_agent_engine_restarts_total") == 1
        assert await process.metric("kvroute_agent_engine_start_time_seconds") == 2_000.0
    finally:
        process.kill()


@pytest.mark.faults
async def test_cleared_cache_is_cleared_in_the_index(engine, agent, index, unique_name):
    pub = engine.publisher
    await pub.publish([stored(0, 6)])
    await wait_for_match(index, unique_name, [6])
    await pub.publish([cleared_event(), stored(0, 1)])
    await wait_for_match(index, unique_name, [1])


@pytest.mark.faults
@pytest.mark.parametrize("kind", server_kinds())
async def test_a_redis_killed_and_replaced_empty_is_complete_again_within_5s(engine, unique_name, kind):
    binary = available_servers()[kind]
    server = RedisServer(binary=binary).start()
    client = RedisSettings(url=server.url).client()  # reconnects after the restart
    index = RedisIndex(client)
    process = AgentProcess(agent_args(engine, server.url)).start()
    try:
        pub = engine.publisher
        await pub.publish([stored(0, 10)])
        await pub.publish([removed(9)])
        await wait_for_match(index, unique_name, [9])
        await engine.publisher.publish([stored(9, 12)])
        await wait_for_match(index, unique_name, [12])
        server.stop(kill=True)
        await pub.publish([stored(12, 15), removed(14)])  # while Redis is down: kept in the mirror

        async def in_the_mirror_only() -> bool:
            metrics = await process.metrics()
            return (
                metrics["kvroute_agent_mirror_indexed_blocks"] == 14 and metrics["kvroute_agent_redis_errors_total"] > 0
            )

        await wait_until(in_the_mirror_only, 10)
        server = RedisServer(binary=binary, port=server.port).start()  # empty, same port
        took = await wait_for_match(index, unique_name, [14], within=5.0)  # no new engine event
        print(f"index complete again {took:.2f} s after the new server started")
        assert (await index.workers(unique_name))[0].blocks == 14
        reasserts = await process.metrics()
        assert sum(v for k, v in reasserts.items() if k.startswith("kvroute_agent_reasserts_total")) >= 1
    finally:
        process.kill()
        await client.aclose()
        server.stop()


async def test_an_agent_binds_for_an_engine_that_connects(unique_name, server, index):
    """vLLM connects its PUB when given a named host (tcp://router-host:5557): the agent binds."""
    port = free_port()
    engine = EngineStandIn(model=unique_name, block_size=BS)
    await engine.start(replay=True, events_endpoint=f"tcp://127.0.0.1:{port}")
    args = agent_args(engine, server.url)
    args[args.index("--events") + 1] = f"tcp://*:{port}"
    process = AgentProcess([*args, "--events-bind"]).start()
    try:
        await wait_until(lambda: registered(index, unique_name), 10)

        async def connected() -> bool:  # a connecting PUB drops what it sends before it is connected
            await engine.publisher.publish([])  # an empty batch: it changes nothing
            return await process.metric("kvroute_agent_batches_received_total") > 0

        await wait_until(connected, 10, interval=0.1)
        await engine.publisher.publish([stored(0, 4)])
        await wait_for_match(index, unique_name, [4])
    finally:
        process.kill()
        await engine.stop()


@pytest.mark.faults
async def test_a_segment_key_lost_in_redis_heals_at_the_next_store_into_it(engine, agent, index, unique_name, server):
    pub = engine.publisher
    await pub.publish([stored(0, 6)])
    await wait_for_match(index, unique_name, [6])
    client = Redis.from_url(server.url)
    try:
        await client.delete(index.keys(unique_name).segment(CHAIN[0]))  # as Redis evicting
    finally:
        await client.aclose()
    await wait_for_match(index, unique_name, [0])
    await pub.publish([stored(6, 8)])  # the page lost the leaf this store moves: re-assert
    await wait_for_match(index, unique_name, [8])

    async def reasserted() -> bool:  # counted once the re-assert's swap is done, a moment after it shows
        return await agent.metric("kvroute_agent_reasserts_total{reason=lost_data}") == 1

    await wait_until(reasserted, 10)


async def test_an_engine_storing_past_its_capacity_cannot_grow_the_index(engine, agent, index, unique_name):
    """A buggy engine that announces more blocks than its KV cache holds: the worker indexes at most
    its capacity (plus kvindex's slack), and the agent counts what it left out."""
    engine.num_gpu_blocks = 4  # the handle's limit: 4 + 4 // 64 + 16 = 20 blocks

    async def capacity_known() -> bool:
        records = await index.workers(unique_name)
        return bool(records) and records[0].load is not None and records[0].load.capacity_blocks == 4

    await wait_until(capacity_known, 10)
    tokens = list(range(1000, 1000 + 32 * BS))
    chain = sequence_hashes(tokens, BS)
    await engine.publisher.publish([stored_event([8_000_000 + i for i in range(32)], None, tokens, BS)])

    async def over_limit_counted() -> bool:
        return await agent.metric("kvroute_agent_blocks_over_limit_total") == 12

    await wait_until(over_limit_counted, 10)
    assert list((await index.match(unique_name, chain)).values()) == [20]
    (record,) = await index.workers(unique_name)
    assert record.blocks == 20


async def test_the_engines_lora_adapters_are_registered_and_followed(engine, index, server, unique_name):
    """The agent learns the base model from a listing that has adapters beside it (vLLM lists each
    with its parent), registers the adapters, and follows the engine loading and unloading them."""
    engine.adapters = ["sql-lora"]
    process = AgentProcess(agent_args(engine, server.url)).start()

    def adapters_are(expected: tuple[str, ...]):
        async def check() -> bool:
            records = await index.workers(unique_name)
            return len(records) == 1 and records[0].alive and records[0].adapters == expected

        return check

    try:
        await wait_until(adapters_are(("sql-lora",)), 15)
        engine.adapters = ["sql-lora", "chat-lora"]
        await wait_until(adapters_are(("chat-lora", "sql-lora")), 10)
        engine.adapters = []
        await wait_until(adapters_are(()), 10)
    finally:
        process.kill()


async def test_every_tier_the_engine_reports_is_indexed_under_its_tier_holder(engine, agent, index, unique_name):
    """vLLM's CPU offloading: blocks copied to the CPU, then evicted from the GPU. The CPU tier's
    holder (a registration of its own, kvindex/tiers.py) keeps them, and a router reads both depths."""
    pub = engine.publisher
    worker = f"{engine.url}#0"
    cpu = tier_holder(worker, "CPU")
    await pub.publish([stored(0, 6)])
    await wait_for_match(index, unique_name, [6])
    await pub.publish([stored(0, 8, medium="CPU")])  # offloaded, and two more only on the CPU

    async def depths_are(expected: dict[str, int]) -> bool:
        return await index.match(unique_name, CHAIN) == expected

    await wait_until(lambda: depths_are({worker: 6, cpu: 8}), 10)
    await pub.publish([removed(5, 4, 3)])  # evicted from the GPU: the CPU still has them
    await wait_until(lambda: depths_are({worker: 3, cpu: 8}), 10)
    records = {r.worker_id: r for r in await index.workers(unique_name)}
    assert (records[cpu].tier, records[cpu].tier_of, records[cpu].blocks) == ("CPU", worker, 8)
    assert (records[worker].tier, records[worker].tier_of) == ("GPU", None)
    await pub.publish([cleared_event()])  # the engine's cache reset: every tier
    await wait_until(lambda: depths_are({worker: 0, cpu: 0}), 10)
    assert agent.terminate() == 0  # a graceful stop deregisters the tier holder too
    assert await index.workers(unique_name) == []
