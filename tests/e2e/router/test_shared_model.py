"""Router replicas learn one cost model together through Redis (real Redis, engines, agents and
HTTP): what one replica observed shows in another's GET /debug/model, and a replica started later
begins with it instead of the priors."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import aiohttp
import pytest

from router.main import RunningRouter
from router.routing.ttft import PRIOR_UTILIZATION
from tests.support import SimFleet, wait_for_workers, wait_until
from tests.support.router import start_router

StartReplica = Callable[[int], Awaitable[RunningRouter]]


async def _learned(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(url + "/debug/model", params={"model": "tiny"}) as response:
        assert response.status == 200
        return await response.json()


async def _stream(session: aiohttp.ClientSession, url: str, count: int) -> None:
    for i in range(count):
        prompt = [(i * 7919 + k * 31) % 1900 + 10 for k in range(64 * (i % 6 + 1))]
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "stream": True}
        async with session.post(url + "/v1/completions", json=body) as reply:
            assert reply.status == 200
            await reply.read()


@asynccontextmanager
async def _fleet_and_replicas(redis_url: str) -> AsyncIterator[tuple[SimFleet, StartReplica]]:
    """Two simulated engines, and a function that starts a router replica seeing both."""
    fleet = await SimFleet(redis_url, count=2, speedup=20).start()
    contexts: list[object] = []

    async def start(model_sync_ms: int) -> RunningRouter:
        context, router = await start_router(redis_url, model_sync_ms=model_sync_ms)
        contexts.append(context)
        await wait_for_workers(router, 2)
        return router

    try:
        yield fleet, start
    finally:
        for context in reversed(contexts):
            await context.__aexit__(None, None, None)  # type: ignore[attr-defined]
        await fleet.stop()


async def test_replicas_share_what_they_learn_and_a_new_one_starts_warm(redis_server):
    async with _fleet_and_replicas(redis_server.url) as (fleet, start), aiohttp.ClientSession() as session:
        first, second = await start(100), await start(100)
        await _stream(session, first.url, 12)  # every request through the first replica
        seen = (await _learned(session, first.url))["observations"]
        assert seen == pytest.approx(12, abs=0.5)

        async def second_learned_them() -> bool:
            learned = await _learned(session, second.url)
            return learned["observations"] == pytest.approx(seen, abs=0.01)

        await wait_until(second_learned_them, 10)
        shared = await _learned(session, second.url)
        assert shared["source"] == "streamed" and shared["shared"]["enabled"] is True
        assert shared["shared"]["syncs"] > 0 and shared["shared"]["last_sync_ms_ago"] is not None
        assert shared["utilization"] != PRIOR_UTILIZATION
        assert {w["id"] for w in shared["workers"]} <= {fleet.worker_id(i) for i in range(fleet.count)}

        late = await start(60_000)  # no periodic sync within the test: only the one at start-up
        learned_late = await _learned(session, late.url)  # and no request through it yet
        assert learned_late["source"] == "streamed" and learned_late["observations"] == pytest.approx(seen, abs=0.5)
        assert learned_late["shared"]["syncs"] == 1


async def test_with_sync_off_each_replica_learns_alone(redis_server):
    async with _fleet_and_replicas(redis_server.url) as (_, start), aiohttp.ClientSession() as session:
        first, second = await start(0), await start(0)
        await _stream(session, first.url, 6)
        assert (await _learned(session, first.url))["observations"] == pytest.approx(6, abs=0.5)
        alone = await _learned(session, second.url)
    assert alone["source"] == "prior" and alone["observations"] == 0
    assert alone["shared"] == {"enabled": False, "last_sync_ms_ago": None, "syncs": 0, "failures": 0}


async def test_debug_model_names_an_unknown_model_in_a_404(router):
    async with aiohttp.ClientSession() as session:
        async with session.get(router.url + "/debug/model", params={"model": "nope"}) as response:
            assert response.status == 404
            assert "nothing is learned of model 'nope'" in (await response.json())["error"]["message"]
        async with session.get(router.url + "/debug/model") as response:
            default = await response.json()
    assert default["model"] == "tiny" and default["models"] == ["tiny"]
