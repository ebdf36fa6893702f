"""A router's load changes ride on its decisions' own Redis batches (a single server): the
separate flush is written only when no decision carried them. A Redis Cluster keeps the flush."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable

import pytest
from redis.asyncio import Redis

from kvindex.keys import KeySchema
from kvindex.scripts import load_scripts
from kvindex.settings import RedisSettings
from kvindex.shared_load import InflightLoad, SharedLoad
from kvroute.devstack.embedded_cluster import LocalCluster
from router.main import RunningRouter
from router.shared.replica_load import FLUSH_WINDOW_S
from tests.support import SimFleet, wait_for_workers, wait_until
from tests.support.router import PREFIX, start_router

BOOKED = InflightLoad(1, 160, 160)


async def _own_fields(redis_url: str, router: RunningRouter, model: str) -> dict[str, str]:
    """This router's in-flight HASH for ``model`` as Redis holds it."""
    load = router.state.load
    client = Redis.from_url(redis_url, decode_responses=True)
    try:
        return await client.hgetall(load.shared.keys(model).inflight(load.shared.replica_id))
    finally:
        await client.aclose()


async def _written(router: RunningRouter) -> None:
    """Until every load change this router made has been written."""
    load = router.state.load

    async def idle() -> bool:
        return load.idle()

    await wait_until(idle, 10, interval=0.001)


@pytest.fixture
async def router(fleet: SimFleet, redis_server) -> AsyncIterator[RunningRouter]:
    """A router whose periodic lease renewal (every third of the lease, the first at its start)
    does not come back during a test: a renewal holds the writer, and a decision's batch then
    carries nothing (the tests below start renewals of their own where they want one)."""
    context, running = await start_router(redis_server.url, lease_ttl_ms=60_000)
    try:
        await wait_for_workers(running, fleet.count)
        yield running
    finally:
        await context.__aexit__(None, None, None)  # type: ignore[attr-defined]


async def _ready_to_carry(router: RunningRouter, model: str, redis_url: str) -> None:
    """The model leased and shared with another replica (a replica alone carries nothing: its
    flush writes the changes later), and nothing being written."""
    client = RedisSettings(url=redis_url).client()
    try:
        await SharedLoad(client, KeySchema(), "another-replica").renew(model, 60_000, {})
    finally:
        await client.aclose()
    await router.state.load.renew_all([model])  # learns of the other replica
    assert not router.state.load.shared.alone(model)
    await _written(router)


async def test_a_decisions_batch_carries_the_pending_booking(router: RunningRouter, redis_server):
    load, decider = router.state.load, router.state.decider
    assert router.state.index.cancel_safe  # a single server: the pipelined connection
    await _ready_to_carry(router, "tiny", redis_server.url)
    flushes = load.flushes
    load.flush_window_s = 60.0  # no flush due while the decision runs, however slow the machine
    load.book("tiny", "carried-w", BOOKED)
    await decider.decide("tiny", PREFIX)  # its replies are read: its batch wrote the booking
    assert load.idle()
    fields = await _own_fields(redis_server.url, router, "tiny")
    assert (fields.get("r:carried-w"), fields.get("t:carried-w")) == ("1", "160")
    assert load.flushes == flushes  # no flush of its own

    load.flush_window_s = FLUSH_WINDOW_S
    load.release("tiny", "carried-w", BOOKED)  # no decision follows: the flush writes it
    await _written(router)
    assert load.flushes == flushes + 1
    assert (await _own_fields(redis_server.url, router, "tiny")).get("r:carried-w", "0") == "0"


async def test_a_renewal_during_a_carrying_decision_counts_its_booking_once(router: RunningRouter, redis_server):
    load, decider = router.state.load, router.state.decider
    await _ready_to_carry(router, "tiny", redis_server.url)
    load.book("tiny", "renewed-w", BOOKED)
    await asyncio.gather(decider.decide("tiny", PREFIX), load.renew_all(["tiny"]))
    await _written(router)
    assert (await load.shared.totals("tiny")).get("renewed-w") == BOOKED
    fields = await _own_fields(redis_server.url, router, "tiny")
    assert (fields.get("r:renewed-w"), fields.get("u:renewed-w")) == ("1", "160")
    load.release("tiny", "renewed-w", BOOKED)


@pytest.fixture
async def cluster_router(redis_cluster: LocalCluster, unique_name: str) -> AsyncIterator[RunningRouter]:
    """As :func:`router`, on a cluster: no periodic renewal comes back during a test."""
    fleet = await SimFleet(redis_cluster.url, model=unique_name).start()
    context, running = await start_router(redis_cluster.url, lease_ttl_ms=60_000)
    try:
        await wait_for_workers(running, fleet.count, unique_name)
        yield running
    finally:
        await context.__aexit__(None, None, None)  # type: ignore[attr-defined]
        await fleet.stop()


async def test_on_a_cluster_the_flush_writes_the_booking(
    cluster_router: RunningRouter, unique_name: str, redis_cluster
):
    load, decider = cluster_router.state.load, cluster_router.state.decider
    assert not cluster_router.state.index.cancel_safe
    await _ready_to_carry(cluster_router, unique_name, redis_cluster.url)
    flushes = load.flushes
    load.flush_window_s = 60.0  # no flush due while the decision runs, however slow the machine
    load.book(unique_name, "cluster-w", BOOKED)
    await decider.decide(unique_name, PREFIX)
    assert not load.idle()  # the decision carried nothing: the booking waits for the flush
    load.flush_now()
    await _written(cluster_router)
    assert load.flushes == flushes + 1
    assert (await load.shared.totals(unique_name)).get("cluster-w") == BOOKED
    load.release(unique_name, "cluster-w", BOOKED)


async def test_a_replica_alone_writes_no_change_of_its_own(router: RunningRouter, redis_server):
    """No other replica reads this one's load: its decisions' round trips carry nothing and no
    flush is written; its lease snapshots (renewed often while alone) keep Redis near its truth."""
    load, decider = router.state.load, router.state.decider
    await load.renew_all(["tiny"])
    await _written(router)
    assert load.shared.alone("tiny")
    flushes = load.flushes
    load.book("tiny", "alone-w", BOOKED)
    assert load.idle()
    await decider.decide("tiny", PREFIX)
    assert load.idle() and load.flushes == flushes

    async def in_a_snapshot() -> bool:  # alone, the lease is renewed every ALONE_RENEWAL_S
        return (await _own_fields(redis_server.url, router, "tiny")).get("r:alone-w") == "1"

    await wait_until(in_a_snapshot, 10, interval=0.01)
    assert load.flushes == flushes
    load.release("tiny", "alone-w", BOOKED)


async def _scripts_run_by(decision: Awaitable[object], redis_url: str) -> set[str]:
    """The names of the scripts Redis ran while ``decision`` ran, seen by MONITOR up to a marker
    sent once it is over (the router's background renewals may show too); a GET of a model's
    alive version (the liveness read between scripts, kvindex.alive_cache) as "alive_version"."""
    names = {script.sha: name for name, script in load_scripts().items()}
    client = Redis.from_url(redis_url, decode_responses=True)
    marker = "end-of-decision"
    seen: set[str] = set()
    try:
        async with client.monitor() as monitor:
            await decision
            await client.echo(marker)  # a connection of the pool's own, not the monitor's
            while True:
                command = (await monitor.next_command())["command"]
                if marker in command:
                    return seen
                words = command.split()
                if words[0].upper().startswith("EVALSHA") and words[1] in names:
                    seen.add(names[words[1]])
                elif words[0].strip('"').upper() == "GET" and words[1].strip('"').endswith(":alive_version"):
                    seen.add("alive_version")
    finally:
        await client.aclose()


async def test_a_replica_alone_reads_only_the_index(router: RunningRouter, redis_server):
    """Alone, no other replica's load or expected prefixes exist to read: the lookup is the
    index's (the match, and liveness: the whole alive set, or the confirmation of this replica's
    copy of it by a script or by a GET of its version). With another replica live, its load and
    expectations are read too."""
    load, decider = router.state.load, router.state.decider
    await load.renew_all(["tiny"])
    assert load.shared.alone("tiny")
    alone = await _scripts_run_by(decider.decide("tiny", PREFIX), redis_server.url)
    liveness = {"alive", "alive_since", "alive_version"}
    assert "page_match" in alone and liveness & alone and not {"inflight", "expected"} & alone

    await _ready_to_carry(router, "tiny", redis_server.url)
    shared = await _scripts_run_by(decider.decide("tiny", PREFIX), redis_server.url)
    assert {"page_match", "inflight", "expected"} <= shared and liveness & shared
