"""Fixtures of the agent's end-to-end tests: one of the session's Redis servers, an index client on
it, and an engine stand-in (the engine's HTTP side and KV-event publisher, in this process)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from kvindex.redis_index import RedisIndex
from kvroute.devstack.embedded_redis import RedisServer
from tests.agent_support import BS
from tests.conftest import server_kinds
from tests.support import EngineStandIn


@pytest.fixture
def server(redis_servers: dict[str, RedisServer]) -> RedisServer:
    return redis_servers[server_kinds()[0]]


@pytest.fixture
async def index(server: RedisServer) -> AsyncIterator[RedisIndex]:
    client = Redis.from_url(server.url)
    yield RedisIndex(client)
    await client.aclose()


@pytest.fixture
async def engine(unique_name: str) -> AsyncIterator[EngineStandIn]:
    stand_in = await EngineStandIn(model=unique_name, block_size=BS).start()
    yield stand_in
    await stand_in.stop()
