"""One suite, every backend: the reference index and RedisIndex on each private server kind."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
from redis.asyncio import Redis

from kvindex.interface import KVIndex
from kvindex.redis_index import RedisIndex
from kvindex.reference import ReferenceIndex
from kvindex.settings import RedisSettings
from kvroute.devstack.embedded_redis import RedisServer, available_servers
from tests.conftest import server_kinds


@pytest.fixture(params=["reference", *server_kinds(), "cluster"])
async def index(request: pytest.FixtureRequest, redis_servers: dict[str, RedisServer]) -> AsyncIterator[KVIndex]:
    """Every backend: the reference, RedisIndex on each server kind, and RedisIndex on a Redis
    Cluster (3 masters, a replica each: the model's index spread over the masters)."""
    if request.param == "reference":
        yield ReferenceIndex()
        return
    if request.param == "cluster":
        url = request.getfixturevalue("redis_cluster").url
    else:
        url = redis_servers[request.param].url
    client = RedisSettings(url=url).client()
    yield RedisIndex(client)
    await client.aclose()


@pytest.fixture
async def redis_client(redis_server: RedisServer) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


@pytest.fixture(params=server_kinds())
def private_redis(request: pytest.FixtureRequest) -> Iterator[RedisServer]:
    """A server of each kind for this test alone: for tests that flush, kill or restart it."""
    server = RedisServer(binary=available_servers()[request.param]).start()
    yield server
    server.stop()
