"""The router through faults: Redis killed mid-traffic, a replica killed, an engine killed."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import aiohttp
import pytest
from redis.asyncio import Redis

from kvindex.keys import KeySchema
from kvindex.shared_load import SharedLoad
from kvroute.devstack.embedded_redis import free_port
from tests.support import ROOT, wait_for_workers, wait_until
from tests.support.router import (
    PREFIX,
    complete,
    start_router,
)


@pytest.mark.faults
async def test_redis_killed_mid_traffic_fails_no_request(fleet, redis_server):
    context, router = await start_router(redis_server.url)
    try:
        await wait_for_workers(router, fleet.count)
        statuses: list[int] = []

        async def traffic() -> None:
            for i in range(60):
                statuses.append((await complete(router.url, [*PREFIX[: 16 * (1 + i % 5)], i]))[0])

        async def some_served() -> bool:
            return len(statuses) >= 10

        task = asyncio.create_task(traffic())
        await wait_until(some_served, 20)  # Redis dies mid-traffic, not before it
        redis_server.stop(kill=True)
        await task
        assert statuses.count(200) == 60, statuses
        assert router.state.decider.degraded_count > 0
        # Redis comes back (empty): the agents re-assert, and the router leaves degraded mode.
        redis_server.start()

        async def recovered() -> bool:
            before = router.state.decider.degraded_count
            url, body = router.url + "/debug/route", {"model": "tiny", "prompt": PREFIX}
            async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
                explained = await response.json()
            return not explained["degraded"] and router.state.decider.degraded_count == before

        await wait_until(recovered, 10)
    finally:
        await context.__aexit__(None, None, None)  # type: ignore[attr-defined]


@pytest.mark.faults
async def test_a_killed_replica_leaves_no_load_behind(fleet, redis_server):
    port = free_port()
    replica = subprocess.Popen(  # noqa: ASYNC220 - starting it does not block
        [
            sys.executable,
            "-m",
            "router",
            "--redis-url",
            redis_server.url,
            "--port",
            str(port),
            "--replica-id",
            "doomed",
        ],
        cwd=ROOT,
    )
    client = Redis.from_url(redis_server.url)
    load = SharedLoad(client, KeySchema(), "observer")
    try:
        url = f"http://127.0.0.1:{port}"

        async def up() -> bool:
            try:
                async with aiohttp.ClientSession() as session, session.get(url + "/ready") as response:
                    return response.status == 200
            except aiohttp.ClientError:
                return False

        await wait_until(up, 30)
        body = {"model": "tiny", "prompt": PREFIX, "max_tokens": 2000, "stream": True}
        session = aiohttp.ClientSession()
        responses = [await session.post(url + "/v1/completions", json=body) for _ in range(3)]

        async def booked() -> bool:
            return sum(x.requests for x in (await load.totals("tiny")).values()) == 3

        await wait_until(booked, 5)
        replica.kill()
        took = await wait_until(lambda: _no_load(load), 10)
        assert took < 4.5  # the lease TTL is 3 s
        for response in responses:
            response.close()
        await session.close()
    finally:
        replica.kill()
        await client.aclose()


async def _no_load(load: SharedLoad) -> bool:
    return await load.totals("tiny") == {}


@pytest.mark.faults
async def test_a_killed_engine_stops_receiving_traffic(fleet, router):
    victim = fleet.worker_id(0)
    fleet.agents[0].kill()  # engine and agent gone together: its HTTP port stays, answers nothing useful
    await fleet.kill_engine(0)
    statuses, workers = [], []

    async def victim_dropped() -> bool:  # traffic goes on while the victim's heartbeat runs out
        status, headers, _ = await complete(router.url, [*PREFIX, len(statuses)])
        statuses.append(status)
        workers.append(headers.get("x-kvroute-worker"))
        return victim not in [w.worker_id for w in router.state.fleet.alive("tiny")]

    await wait_until(victim_dropped, 20, interval=0)
    for i in range(10):
        status, headers, _ = await complete(router.url, [*PREFIX, 1000 + i])
        statuses.append(status)
        workers.append(headers.get("x-kvroute-worker"))
    assert statuses.count(200) == len(statuses)  # a failure before the first byte is retried elsewhere
    assert victim not in workers[-10:]
