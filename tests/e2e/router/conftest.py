"""Fixtures of the router's end-to-end tests: a private Redis, three simulated engines with agent
processes, and a router replica in this event loop."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from kvindex.redis_index import RedisIndex
from kvroute.devstack.embedded_redis import RedisServer, available_servers
from router.main import RunningRouter
from tests.support import SimFleet, wait_for_workers
from tests.support.router import start_router


@pytest.fixture
async def redis_server() -> AsyncIterator[RedisServer]:
    servers = available_servers()  # redis-server, or only the Valkey binary: either will do
    server = RedisServer(binary=servers.get("redis") or servers["valkey"]).start()
    yield server
    server.stop()


@pytest.fixture
async def fleet(redis_server: RedisServer) -> AsyncIterator[SimFleet]:
    fleet = await SimFleet(redis_server.url).start()
    yield fleet
    await fleet.stop()


@pytest.fixture
async def router(fleet: SimFleet, redis_server: RedisServer) -> AsyncIterator[RunningRouter]:
    context, running = await start_router(redis_server.url)
    await wait_for_workers(running, fleet.count)
    yield running
    await context.__aexit__(None, None, None)  # type: ignore[attr-defined]


@pytest.fixture
async def index(redis_server) -> AsyncIterator[RedisIndex]:
    client = Redis.from_url(redis_server.url)
    yield RedisIndex(client)
    await client.aclose()
