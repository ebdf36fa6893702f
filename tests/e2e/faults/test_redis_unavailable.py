"""Redis there but not answering: stopped (SIGSTOP) for longer than the heartbeat TTL, and slow
(every reply delayed past the router's 50 ms budget by a TCP proxy). Requests must succeed
(degraded routing) and the index must come back whole."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from tests.e2e.faults.measure import open_scene
from tests.support.proxy import LatencyProxy

pytestmark = pytest.mark.faults

STOPPED_S = 5.0  # the fault itself: longer than the agents' 3 s heartbeat TTL


async def test_redis_stopped_for_5_s(redis_server):
    async with open_scene(redis_server, redis_timeout_s=0.05) as scene:
        await scene.prime()
        assert redis_server.process is not None
        os.kill(redis_server.process.pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(STOPPED_S)  # the length of the fault, not a wait for anything
        finally:
            os.kill(redis_server.process.pid, signal.SIGCONT)
        since = time.monotonic()
        recovery = await scene.recover(since)
        degraded = sum(r.state.decider.degraded_count for r in scene.routers)
        figures = scene.figures("redis_sigstop_5s", [recovery], degraded_decisions=degraded)
        scene.check(figures, [recovery])
        assert degraded > 0  # the traffic did run while Redis was stopped


SLOW_S = 0.2  # each way, on every chunk: four times the router's 50 ms budget


async def test_a_slow_redis_between_router_and_index(redis_server):
    proxy = await LatencyProxy(redis_server.port).start()
    try:
        async with open_scene(redis_server, router_redis_url=proxy.url, redis_timeout_s=0.05) as scene:
            await scene.prime()
            opened = proxy.accepted
            proxy.latency_s = SLOW_S
            router = scene.routers[0].state.decider
            degraded_before = router.degraded_count
            await scene.traffic.progressed(60)
            proxy.latency_s = 0.0
            since = time.monotonic()
            reconnects = proxy.accepted - opened
            degraded = router.degraded_count - degraded_before
            recovery = await scene.recover(since)
            figures = scene.figures(
                "slow_redis_200ms", [recovery], degraded_decisions=degraded, connections_opened_while_slow=reconnects
            )
            scene.check(figures, [recovery])
            assert degraded > 0  # the decisions did meet the slow Redis
            # No reconnect storm (the old router opened one per decision: ~60 here). The pool is
            # bounded (--redis-pool-size 32) and may grow to its bound from its warm size while slow;
            # the margin covers the load writer's and lease's own connections being replaced.
            assert reconnects <= 40
    finally:
        await proxy.stop()
