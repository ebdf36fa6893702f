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
