"""The agent process under the engine's, Redis's and its own transient trouble: bad /metrics values,
a Redis whose INFO lacks run_id, a replay that stalls, a /health that hangs, a flood of messages.
Trouble degrades (a value ignored, heartbeats paused, a resync); it never crashes the agent, never
deregisters a healthy worker and never leaves an index that credits blocks the engine lacks."""

from __future__ import annotations

import pytest

from kvindex.redis_index import RedisIndex
from kvindex.settings import RedisSettings
from kvindex.types import WorkerLoad
from kvroute.devstack.embedded_redis import RedisServer, available_servers
from sim_engine.kv_events import removed_event
from tests.conftest import server_kinds
from tests.e2e.agent.conftest import FaultyEngine, RedisProxy, gated_agent, start_agent, stop_agent
from tests.support import wait_until
from tests.support.agent import BS, CHAIN, registered, removed, stored, wait_for_match

LOAD_LINES = (
    'vllm:num_requests_running{{engine="0"}} {}\nvllm:num_requests_waiting{{engine="0"}} {}\n'
    'vllm:kv_cache_usage_perc{{engine="0"}} {}\n'
)


@pytest.mark.faults
async def test_bad_engine_metrics_are_counted_logged_once_and_never_stored(engine, server, index, unique_name):
    process = start_agent(engine, server.url)
    try:
        engine.load = (2, 1, 0.5)

        async def load_is(expected: WorkerLoad) -> bool:
            records = await index.workers(unique_name)
            return bool(records) and records[0].alive and records[0].load == expected

        await wait_until(lambda: load_is(WorkerLoad(2, 1, 0.5)), 15)
        errors = 0.0
        for running, waiting, usage in (("+Inf", 0, 0.25), (3, 0, "NaN"), (3, "many", 0.25)):
            engine.metrics_page = LOAD_LINES.format(running, waiting, usage)

            async def counted(before: float = errors) -> bool:
                return await process.metric("kvroute_agent_engine_metric_errors_total") >= before + 3

            await wait_until(counted, 10)  # three scrapes of the bad page at least
            errors = await process.metric("kvroute_agent_engine_metric_errors_total")
            assert process.process is not None and process.process.poll() is None, process.log()
            (record,) = await index.workers(unique_name)
            assert record.alive and record.load == WorkerLoad(2, 1, 0.5)  # the last good load stays
        engine.metrics_page = LOAD_LINES.format(3, 0, 0.25)
        await wait_until(lambda: load_is(WorkerLoad(3, 0, 0.25)), 10)
        assert await registered(index, unique_name)
        warnings = [line for line in process.log().splitlines() if "ignoring the engine's" in line]
        assert len(warnings) == 3, warnings  # one per metric, however many scrapes
        assert any("vllm:num_requests_running: +Inf" in line for line in warnings)
        assert any("vllm:kv_cache_usage_perc: NaN" in line for line in warnings)
        assert any("vllm:num_requests_waiting: not a number" in line for line in warnings)
    finally:
        stop_agent(process)


@pytest.mark.faults
async def test_a_redis_info_without_run_id_is_no_crash_and_a_lost_record_still_heals(engine, unique_name):
    binary = available_servers()[server_kinds()[0]]
    server = RedisServer(binary=binary).start()
    proxy = await RedisProxy(server.port, hide_run_id=True).start()
    client = RedisSettings(url=server.url).client()  # reconnects after the restart
    index = RedisIndex(client)
    process = start_agent(engine, proxy.url, "--verify-interval", "0.2")
    try:
        await engine.publisher.publish([stored(0, 5)])
        await wait_for_match(index, unique_name, [5])
        checks = await process.metric("kvroute_agent_verifications_total")

        async def checked_again() -> bool:  # the liveness step (which reads INFO) keeps running
            return await process.metric("kvroute_agent_verifications_total") >= checks + 3

        await wait_until(checked_again, 10)
        server.stop(kill=True)
        server = RedisServer(binary=binary, port=server.port).start()  # empty: the record is gone
        await wait_for_match(index, unique_name, [5])  # no run_id to compare: the record's state says it
        metrics = await process.metrics()
        # Either the heartbeat finds the record missing or the 0.2 s block-count check finds it
        # drifted, whichever runs first after the restart; a run_id-based heal cannot happen.
        healed = metrics.get("kvroute_agent_reasserts_total{reason=missing}", 0.0) + metrics.get(
            "kvroute_agent_reasserts_total{reason=drift}", 0.0
        )
        assert healed >= 1, metrics
        assert metrics.get("kvroute_agent_reasserts_total{reason=redis_restart}", 0.0) == 0
        assert process.process is not None and process.process.poll() is None
        notes = [line for line in process.log().splitlines() if "no run_id" in line]
        assert len(notes) == 1, notes
    finally:
        stop_agent(process)
        await proxy.stop()
        await client.aclose()
        server.stop()


@pytest.mark.faults
async def test_heartbeats_go_on_while_a_replay_stalls(engine, gate, server, index, unique_name):
    await engine.publisher.publish([stored(0, 4)])  # buffered: the agent's catch-up replays it
    gate.stall = True
    process = gated_agent(engine, server.url, gate, "--ttl-ms", "3000", "--replay-deadline", "120")
    try:
        await wait_until(lambda: registered(index, unique_name), 15)
        beats = await process.metric("kvroute_agent_heartbeats_total")
        lapses = []

        async def alive_for_two_ttls() -> bool:  # 6 heartbeats at 1 s: twice the 3 s TTL
            if not await registered(index, unique_name):
                lapses.append(await index.workers(unique_name))
            return await process.metric("kvroute_agent_heartbeats_total") >= beats + 6

        await wait_until(alive_for_two_ttls, 20)
        assert not lapses, lapses
        assert gate.requests == 1 and await process.metric("kvroute_agent_replays_timed_out_total") == 0
        assert await index.match(unique_name, CHAIN) == {f"{engine.url}#0": 0}  # still replaying
        gate.stall = False  # the drip stops: the answer goes idle and the catch-up applies it
        await wait_for_match(index, unique_name, [4])
    finally:
        stop_agent(process)


@pytest.mark.faults
async def test_a_replay_that_never_ends_is_cut_at_its_deadline(engine, gate, server, index, unique_name):
    await engine.publisher.publish([stored(0, 4)])
    gate.stall = True
    process = gated_agent(engine, server.url, gate, "--replay-deadline", "1")
    try:

        async def cut() -> bool:
            return await process.metric("kvroute_agent_replays_timed_out_total") >= 1

        await wait_until(cut, 15)
        await wait_for_match(index, unique_name, [4])  # what came before the deadline is applied
        await engine.publisher.publish([stored(4, 6)])  # the next seq: in order, no gap
        await wait_for_match(index, unique_name, [6])
        assert gate.requests == 1 and await process.metric("kvroute_agent_resyncs_total") == 0
    finally:
        stop_agent(process)


@pytest.mark.faults
@pytest.mark.parametrize("trouble", ["hangs", "says 503"])
async def test_an_engine_away_for_a_while_comes_back_with_its_entries(engine, server, index, unique_name, trouble):
    """A /health that times out or fails is an engine away, not a new one: heartbeats pause (the
    worker leaves routing), the entries stay, and the same process (same start time) is back whole."""
    engine.start_time = 1_000.0
    process = start_agent(engine, server.url, "--ttl-ms", "2000")
    try:
        await engine.publisher.publish([stored(0, 5)])
        await wait_for_match(index, unique_name, [5])
        if trouble == "hangs":
            engine.hang_health()  # each check times out (2 s)
        else:
            engine.healthy = False

        async def engine_down() -> bool:
            return await process.metric("kvroute_agent_engine_down_total") == 1

        await wait_until(engine_down, 30)
        await wait_for_match(index, unique_name, [], within=10)  # out of routing once the TTL ran out
        status, body = await process.health()
        assert status == 503 and body["status"] == "engine_down"
        engine.answer_health()
        engine.healthy = True
        await wait_for_match(index, unique_name, [5], within=15)  # no new event needed
        assert await process.metric("kvroute_agent_engine_restarts_total") == 0
        assert await process.metric("kvroute_agent_resyncs_total") == 0
    finally:
        engine.answer_health()
        stop_agent(process)


@pytest.mark.faults
async def test_an_engine_counter_going_back_is_a_restart_without_waiting_for_an_event(
    engine, server, index, unique_name
):
    engine.prompt_tokens = 500.0  # no process_start_time_seconds: the counters are the evidence
    process = start_agent(engine, server.url)
    try:
        await engine.publisher.publish([stored(0, 5)])
        await wait_for_match(index, unique_name, [5])
        engine.publisher.restart()  # a new process: nothing buffered, seq from 0
        engine.prompt_tokens = 12.0
        await wait_for_match(index, unique_name, [0])
        await engine.publisher.publish([stored(0, 2)])
        await wait_for_match(index, unique_name, [2])
        assert await process.metric("kvroute_agent_engine_restarts_total") == 1
        assert "vllm:prompt_tokens_total went back from 500 to 12" in process.log()
    finally:
        stop_agent(process)


@pytest.mark.faults
async def test_a_full_inbox_drops_messages_and_the_index_ends_exact(engine, gate, server, index, unique_name):
    """While a replay holds the event stream, a burst overflows the agent's inbox (4 messages here):
    the dropped ones are a gap like any other, repaired from the engine's buffer."""
    args = ("--max-queued-messages", "4", "--replay-deadline", "3")
    process = gated_agent(engine, server.url, gate, *args)
    pub = engine.publisher
    try:
        await wait_until(lambda: registered(index, unique_name), 15)
        await pub.publish([stored(0, 8)])
        await wait_for_match(index, unique_name, [8])
        gate.stall = True
        await pub.publish([removed(7)], deliver=False)  # lost: the next one opens a gap -> a replay
        await pub.publish([removed(6)])

        async def replaying() -> bool:
            return gate.requests == 2  # the start-up catch-up, then this gap

        await wait_until(replaying, 10)
        burst = [[removed(b)] for b in (5, 4, 3, 2, 1)] + [[stored(1, 2)], [stored(2, 3)], [removed(2)]]
        for events in burst:  # 4 wait in the inbox, 4 are dropped, among them the last removal
            await pub.publish(events)
        gate.stall = False

        async def dropped() -> bool:
            return await process.metric("kvroute_agent_dropped_messages_total") >= 1

        await wait_until(dropped, 10)
        # No later message is needed to show the gap: the agent knows it dropped some.
        await wait_for_match(index, unique_name, [2])  # the engine holds blocks 0 and 1
        assert await process.metric("kvroute_agent_resyncs_total") == 0
        assert any("dropped" in line and "--max-queued-messages 4" in line for line in process.log().splitlines())
    finally:
        stop_agent(process)


@pytest.mark.faults
async def test_a_message_over_the_size_limit_never_reaches_the_index(engine, server, index, unique_name):
    process = start_agent(engine, server.url, "--max-message-bytes", "65536")
    pub = engine.publisher
    try:
        await pub.publish([stored(0, 4)])
        await wait_for_match(index, unique_name, [4])
        noise = [removed_event([10**12 + i]) for i in range(3000)]  # removals of unknown blocks
        frames = await pub.publish([stored(4, 6), *noise])
        assert len(frames[2]) > 65536
        received = await process.metric("kvroute_agent_batches_received_total")

        async def connected_again() -> bool:  # ZMQ dropped the connection on it; the agent reconnects
            await pub.publish([])
            return await process.metric("kvroute_agent_batches_received_total") > received

        await wait_until(connected_again, 15, interval=0.2)

        async def resynced() -> bool:  # the replay socket refuses the big message too: unrepairable
            return await process.metric("kvroute_agent_resyncs_total") == 1

        await wait_until(resynced, 15)
        await wait_for_match(index, unique_name, [0])  # cleared rather than guessed: blocks 4, 5 never indexed
        assert await process.metric("kvroute_agent_blocks_stored_total") == 4
        assert await process.metric("kvroute_agent_events_disconnects_total") >= 1
        assert process.process is not None and process.process.poll() is None
    finally:
        stop_agent(process)


@pytest.mark.faults
async def test_without_replay_drops_never_leave_blocks_the_engine_lacks(server, index, unique_name):
    """Redis stops answering mid-write; a burst overflows the inbox; with no replay endpoint the
    dropped removals are lost for good: the worker is cleared rather than left claiming them."""
    engine = await FaultyEngine(model=unique_name, block_size=BS).start(replay=False)
    proxy = await RedisProxy(server.port).start()
    process = start_agent(engine, proxy.url, "--max-queued-messages", "4", replay=False)
    pub = engine.publisher
    try:
        await wait_until(lambda: registered(index, unique_name), 15)
        await pub.publish([stored(0, 8)])
        await wait_for_match(index, unique_name, [8])
        proxy.pause()
        await pub.publish([removed(7)])

        async def writing() -> bool:  # the agent took it and is waiting on Redis (2 s timeout)
            return await process.metric("kvroute_agent_batches_received_total") == 2

        await wait_until(writing, 10)
        for block in (6, 5, 4, 3, 2, 1):  # 4 wait in the inbox; the removals of 2 and 1 are dropped
            await pub.publish([removed(block)])

        async def dropped() -> bool:
            return await process.metric("kvroute_agent_dropped_messages_total") >= 1

        await wait_until(dropped, 10)
        proxy.resume()  # no later message is needed: the agent knows it dropped some
        await wait_for_match(index, unique_name, [0])  # the engine holds block 0 alone; never more claimed
        assert await process.metric("kvroute_agent_resyncs_total") == 1
    finally:
        stop_agent(process)
        await proxy.stop()
        await engine.stop()


@pytest.mark.faults
async def test_a_redis_that_stops_answering_for_a_while_only_pauses_the_worker(engine, server, index, unique_name):
    """Longer than the TTL: the worker drops out of routing, events keep reaching the mirror, and
    once Redis answers the worker is back whole, with nothing cleared."""
    proxy = await RedisProxy(server.port).start()
    process = start_agent(engine, proxy.url, "--ttl-ms", "2000")
    pub = engine.publisher
    try:
        await pub.publish([stored(0, 6)])
        await wait_for_match(index, unique_name, [6])
        proxy.pause()
        await pub.publish([stored(6, 9), removed(8)])  # applied to the mirror; Redis does not answer

        async def out_of_routing_and_failing() -> bool:
            failing = await process.metric("kvroute_agent_redis_errors_total") >= 1
            return failing and not await registered(index, unique_name)

        await wait_until(out_of_routing_and_failing, 20)
        proxy.resume()
        await wait_for_match(index, unique_name, [8])
        assert await registered(index, unique_name)
        metrics = await process.metrics()
        assert metrics["kvroute_agent_resyncs_total"] == metrics["kvroute_agent_engine_restarts_total"] == 0
        assert metrics["kvroute_agent_clears_total"] == 0 and metrics["kvroute_agent_engine_up"] == 1
    finally:
        stop_agent(process)
        await proxy.stop()
