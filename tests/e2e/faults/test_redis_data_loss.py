"""Redis loses the index: killed and restarted empty (workers come back in another order each
round, so an empty Redis hands their old gids to other workers), and FLUSHALL under traffic."""

from __future__ import annotations

import signal
import time

import pytest
from redis.exceptions import RedisError

from kvindex.redis_index import RedisIndex
from tests.e2e.faults.measure import MODEL, Scene, open_scene
from tests.support import wait_until

pytestmark = pytest.mark.faults

# Each round's order of return, never the order of the round before it.
ORDERS = [[2, 1, 0], [1, 0, 2], [0, 2, 1]]


async def registered(scene: Scene, index: int) -> bool:
    try:
        workers = await RedisIndex(scene.client).workers(MODEL)
    except (RedisError, OSError):
        return False
    return any(w.worker_id == scene.worker(index) and w.alive for w in workers)


async def test_redis_killed_and_restarted_empty_with_workers_in_another_order(redis_server):
    async with open_scene(redis_server) as scene:
        agents = [a.process for a in scene.fleet.agents]
        recoveries = []
        try:
            for order in ORDERS:
                await scene.prime()
                for process in agents:
                    process.send_signal(signal.SIGSTOP)  # so that they come back in `order`
                redis_server.stop(kill=True)
                await scene.traffic.progressed(10)  # requests go on while Redis is down
                redis_server.start()
                since = time.monotonic()
                for index in order:
                    agents[index].send_signal(signal.SIGCONT)
                    await wait_until(lambda index=index: registered(scene, index), 20)
                recoveries.append(await scene.recover(since))
        finally:
            for process in agents:
                process.send_signal(signal.SIGCONT)
        figures = scene.figures("redis_kill9_empty_restart", recoveries, rounds=len(ORDERS))
        scene.check(figures, recoveries)


async def test_flushall_under_traffic(redis_server):
    async with open_scene(redis_server) as scene:
        recoveries = []
        for _ in range(4):
            await scene.prime()
            await scene.client.flushall()
            since = time.monotonic()
            await scene.traffic.progressed(20)
            recoveries.append(await scene.recover(since))
        figures = scene.figures("flushall", recoveries, rounds=4)
        scene.check(figures, recoveries)
