"""The router's view of the workers through Redis losing its data: the last known workers keep
serving (routing degrades, requests succeed) until Redis shows workers again."""

from __future__ import annotations

import signal

import pytest
from redis.asyncio import Redis

from router.main import RunningRouter
from tests.support import wait_for_workers, wait_until
from tests.support.router import PREFIX, start_router
from tests.support.traffic import Traffic

# shared prefixes of 1 to 5 blocks, as the router suite's prompts are
PROMPTS = [PREFIX[: 16 * blocks] for blocks in range(1, 6)]


async def _redis_shows_workers_again(router: RunningRouter, count: int) -> None:
    """Wait until a refresh read ``count`` alive workers from Redis itself (none kept from before)."""

    async def back() -> bool:
        fleet = router.state.fleet
        return not fleet.retained_models() and len(fleet.alive("tiny")) == count and fleet.last_error is None

    await wait_until(back, 30)


async def _retained(router: RunningRouter) -> None:
    """Wait until a refresh read the empty index and kept the last known workers."""

    async def retained() -> bool:
        return router.state.fleet.retained_models() == ["tiny"]

    await wait_until(retained, 10)


@pytest.mark.faults
async def test_flushall_during_traffic_fails_no_request(fleet, redis_server):
    context, router = await start_router(redis_server.url, workers_refresh_s=0.2)
    client = Redis.from_url(redis_server.url)
    try:
        await wait_for_workers(router, fleet.count)
        traffic = Traffic([router.url], PROMPTS, concurrency=4).start()
        await traffic.progressed(20)
        # The agents are held while Redis is flushed, so that the router sees the empty index
        # before they re-register (an agent whose engine stores a block re-registers at once, so
        # otherwise the test would depend on who is faster: a refresh or the next request).
        for agent in fleet.agents:
            agent.process.send_signal(signal.SIGSTOP)
        await client.flushall()

        await _retained(router)
        await traffic.progressed(20)
        for agent in fleet.agents:
            agent.process.send_signal(signal.SIGCONT)
        await _redis_shows_workers_again(router, fleet.count)
        await traffic.progressed(20)
        await traffic.stop()
        assert traffic.failed == 0, traffic.failures[:3]
        assert traffic.completed >= 60
    finally:
        await client.aclose()
        await context.__aexit__(None, None, None)  # type: ignore[attr-defined]


@pytest.mark.faults
async def test_redis_killed_and_restarted_empty_during_traffic_fails_no_request(fleet, redis_server):
    context, router = await start_router(redis_server.url, workers_refresh_s=0.2)
    try:
        await wait_for_workers(router, fleet.count)
        traffic = Traffic([router.url], PROMPTS, concurrency=4).start()
        for round_ in range(2):
            await traffic.progressed(20)
            redis_server.stop(kill=True)
            await traffic.progressed(20)  # Redis down: served from the last known workers, by local load
            # The agents are held while Redis restarts empty, so that the router sees the empty
            # index before they re-register (else the test would depend on who is faster).
            agents = fleet.agents if round_ == 0 else fleet.agents[::-1]
            for agent in agents:
                agent.process.send_signal(signal.SIGSTOP)
            redis_server.start()
            await _retained(router)
            await traffic.progressed(20)
            for agent in agents:  # released in another order in the second round
                agent.process.send_signal(signal.SIGCONT)
            await _redis_shows_workers_again(router, fleet.count)
        await traffic.progressed(20)
        await traffic.stop()
        assert traffic.failed == 0, traffic.failures[:3]
        assert router.state.decider.degraded_count > 0
    finally:
        for agent in fleet.agents:
            agent.process.send_signal(signal.SIGCONT)
        await context.__aexit__(None, None, None)  # type: ignore[attr-defined]
