"""The router over a Redis slower than its decision budget (a real server behind a proxy that
delays every byte): decisions degrade at once, requests succeed, and the connections to Redis
stay few (late replies are read and discarded by the pipelined connection, not cut off by
closing their connection)."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
import uvloop
from redis.asyncio import Redis

from kvindex.scripts import Scripts
from kvindex.settings import RedisSettings
from router.routing.lookups import Lookups, _StallGuard
from tests.support import raw_call, wait_for_workers, wait_until
from tests.support.proxy import LatencyProxy
from tests.support.router import PREFIX, complete, start_router

POOL = 8


async def _router_connections(observer: Redis, proxy: LatencyProxy) -> int:
    """The router's connections (through the proxy) in the real server's CLIENT LIST."""
    clients = await observer.client_list()
    ports = set(proxy.upstream_ports)
    return sum(1 for c in clients if int(c["addr"].rsplit(":", 1)[1]) in ports)


@pytest.mark.faults
async def test_a_redis_slower_than_the_budget_degrades_without_a_reconnect_storm(fleet, redis_server):
    proxy = await LatencyProxy(redis_server.port).start()
    context, router = await start_router(proxy.url, redis_timeout_s=0.05, redis_pool_size=POOL)
    observer = Redis.from_url(redis_server.url, decode_responses=True)
    most = 0
    sampling = True

    async def sample() -> None:  # the router's connections as the real server lists them
        nonlocal most
        while sampling:
            most = max(most, await _router_connections(observer, proxy))
            await asyncio.sleep(0.01)

    try:
        await wait_for_workers(router, fleet.count)
        decider = router.state.decider
        assert decider.lookups.cancel_safe  # a single server: lookups in the decisions' own tasks
        proxy.latency_s = 0.15  # each way: a lookup takes >= 300 ms against a 50 ms budget
        opened_before = proxy.accepted
        sampler = asyncio.create_task(sample())
        statuses: list[int] = []
        for burst in range(4):
            replies = await asyncio.gather(*(complete(router.url, [*PREFIX, burst, i]) for i in range(40)))
            statuses += [status for status, _, _ in replies]
        sampling = False
        await sampler
        assert statuses == [200] * 160
        assert decider.degraded_count >= 100, decider.degraded_count
        assert 0 < most <= POOL, most  # the pool's bound, on the real server
        assert proxy.accepted - opened_before <= POOL, proxy.accepted - opened_before  # no reconnect storm

        async def late_replies_read() -> bool:  # the lookups left behind finish and are counted
            return decider.lookups.late_replies > 0 and decider.lookups.in_flight == 0

        await wait_until(late_replies_read, 10)
        async with aiohttp.ClientSession() as session, session.get(router.url + "/metrics") as response:
            metrics = await response.text()
        assert 'kvroute_router_degraded_causes_total{cause="budget"}' in metrics
        assert "kvroute_router_redis_late_replies_total" in metrics

        proxy.latency_s = 0.0

        async def routed_by_the_index_again() -> bool:
            before = decider.degraded_count
            status, _, _ = await complete(router.url, [*PREFIX, 99])
            return status == 200 and decider.degraded_count == before

        await wait_until(routed_by_the_index_again, 10)
    finally:
        sampling = False
        await observer.aclose()
        await context.__aexit__(None, None, None)  # type: ignore[attr-defined]
        await proxy.stop()


def _spin(seconds: float) -> None:
    """Keep the event loop's thread busy, as tokenizing and hashing a burst of long prompts does."""
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


@pytest.mark.parametrize("loop_factory", [uvloop.new_event_loop, asyncio.new_event_loop], ids=["uvloop", "asyncio"])
@pytest.mark.parametrize("stall_s", [0.0, 0.12])
@pytest.mark.parametrize("server", ["single", "cluster"])
def test_a_router_busy_past_the_budget_still_uses_the_reply_redis_sent_in_time(request, server, stall_s, loop_factory):
    """A router busy past a decision's deadline must not take its own stall for a slow Redis
    (and route by round robin): after the stall, a loop can run the budget's due timer before
    the task that the reply woke up, on uvloop (the router's loop) as on asyncio's own; on a
    single server (the lookup in the decision's task) as on a cluster (in a task of its own)."""
    url = request.getfixturevalue("redis_cluster" if server == "cluster" else "redis_server").url

    async def lookup_through_a_stall() -> int:
        client = RedisSettings(url=url).client(command_timeouts=False)
        scripts = Scripts(client)
        lookups = Lookups(4, budget_s=0.05, backstop_s=2.0, cancel_safe=scripts.cancel_safe)
        call = [raw_call("alive", ["kvr:{stall}:alive"])]
        try:
            assert scripts.cancel_safe == (server == "single")
            await scripts.call_many(call)  # connected, scripts loaded: the next call is one write and one read
            asyncio.get_running_loop().call_soon(_spin, stall_s)  # runs once the lookup is on the wire
            (alive,) = await lookups.run(lambda: scripts.call_many(call))
            assert not isinstance(alive, Exception), alive
            return lookups.stall_graces
        finally:
            await scripts.aclose()
            await client.aclose()

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        graces = runner.run(lookup_through_a_stall())
    # Whether the deadline had to move, and how often, depends on the order the loop ran its
    # timers and its sockets in after the stall, and on the machine (a cluster's reply passes
    # through more tasks: on a loaded machine they may take longer than one grace); never more
    # than the guard allows, and never without a stall.
    assert graces <= (_StallGuard.MAX_GRACES if stall_s else 0)
