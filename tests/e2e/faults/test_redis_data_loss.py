"""Redis loses the index: killed and restarted empty, and FLUSHALL, under traffic. The agents are
held (SIGSTOP) until every router has read the empty Redis and served requests from it, then come
back in another order each round, so that an empty Redis would hand their old gids to other
workers. Requests must all succeed; the index must come back whole and credit nobody wrongly."""

from __future__ import annotations

import signal
import time
from collections.abc import Awaitable, Callable

import pytest
from redis.exceptions import RedisError

from kvindex.redis_index import RedisIndex
from tests.e2e.faults.measure import MODEL, Recovery, Scene, open_scene
from tests.support import wait_until

pytestmark = pytest.mark.faults

# Each round's order of return, never the order of the round before it.
ORDERS = [[2, 1, 0], [1, 0, 2], [0, 2, 1], [2, 0, 1]]


async def registered(scene: Scene, index: int) -> bool:
    try:
        workers = await RedisIndex(scene.client).workers(MODEL)
    except (RedisError, OSError):
        return False
    return any(w.worker_id == scene.worker(index) and w.alive for w in workers)


async def lose_data(scene: Scene, lose: Callable[[], Awaitable[None]], order: list[int]) -> Recovery:
    """One round: hold the agents, ``lose`` the data, let every router see the empty index while
    the traffic goes on, then let the agents back one by one in ``order``."""
    await scene.prime()
    agents = [a.process for a in scene.fleet.agents]
    for process in agents:
        process.send_signal(signal.SIGSTOP)
    try:
        await lose()
        lost_at = time.monotonic()

        async def routers_saw_it() -> bool:
            return all(r.state.fleet.refreshed_at > lost_at for r in scene.routers)

        await wait_until(routers_saw_it, 20)
        await scene.traffic.progressed(10)
        for index in order:
            agents[index].send_signal(signal.SIGCONT)
            await wait_until(lambda index=index: registered(scene, index), 20)

        # A router retains the last known workers from the first listing without them until one
        # lists them again; a round shorter than its refresh would carry that retention into the
        # next round, whose loss then outlasts --worker-retain-s on a slow machine.
        async def routers_list_them() -> bool:
            return all(not r.state.fleet.retained_models() for r in scene.routers)

        await wait_until(routers_list_them, 20)
    finally:
        for process in agents:
            process.send_signal(signal.SIGCONT)
    return await scene.recover(lost_at)


async def test_redis_killed_and_restarted_empty(redis_server):
    async def kill_and_restart() -> None:
        redis_server.stop(kill=True)
        await scene.traffic.progressed(10)  # requests go on while Redis is down
        redis_server.start()

    async with open_scene(redis_server) as scene:
        recoveries = [await lose_data(scene, kill_and_restart, order) for order in ORDERS[:3]]
        figures = scene.figures("redis_kill9_empty_restart", recoveries, rounds=len(recoveries))
        scene.check(figures, recoveries)


async def test_flushall(redis_server):
    async def flushall() -> None:
        await scene.client.flushall()

    async with open_scene(redis_server) as scene:
        recoveries = [await lose_data(scene, flushall, order) for order in ORDERS]
        figures = scene.figures("flushall", recoveries, rounds=len(recoveries))
        scene.check(figures, recoveries)
