"""The router over a Redis slower than its decision budget (a real server behind a proxy that
delays every byte): decisions degrade at once, requests succeed, and the connections to Redis
stay few (late replies are read and discarded by the pipelined connection, not cut off by
closing their connection)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from redis.asyncio import Redis

from tests.e2e.router.support import PREFIX, complete, start_router, wait_for_workers
from tests.support import wait_until
from tests.support_proxy import LatencyProxy

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
