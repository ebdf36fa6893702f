"""One client factory: ``RedisSettings.client()`` (asyncio) and ``sync_client()`` (blocking) reach
the same server by the same URL rules, standalone and cluster."""

from __future__ import annotations

import pytest
import redis.exceptions

from kvindex.settings import RedisSettings
from kvroute.devstack.embedded_redis import RedisServer


async def _written_then_read_back(url: str, key: str) -> bytes | None:
    settings = RedisSettings(url=url)
    client = settings.client()
    try:
        await client.set(key, b"written by the asyncio client")
    finally:
        await client.aclose()
    blocking = settings.sync_client()
    try:
        return blocking.get(key)  # type: ignore[return-value]
    finally:
        blocking.close()


async def test_both_clients_reach_one_server(redis_server: RedisServer, unique_name: str) -> None:
    assert await _written_then_read_back(redis_server.url, unique_name) == b"written by the asyncio client"


async def test_both_clients_reach_one_cluster(redis_cluster, unique_name: str) -> None:
    assert redis_cluster.url.startswith("redis+cluster://")
    assert await _written_then_read_back(redis_cluster.url, unique_name) == b"written by the asyncio client"


def test_the_blocking_client_bounds_each_command_by_the_socket_timeout() -> None:
    client = RedisSettings(url="redis://127.0.0.1:1/0", socket_timeout_s=0.25).sync_client()
    options = client.connection_pool.connection_kwargs  # type: ignore[union-attr]
    assert (options["socket_timeout"], options["socket_connect_timeout"]) == (0.25, 0.25)
    with pytest.raises(redis.exceptions.ConnectionError):
        client.ping()
