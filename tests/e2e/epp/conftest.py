"""Fixtures of the endpoint picker's tests: the router tests' Redis and simulated fleet, an
endpoint picker in this event loop, and a gRPC channel to it (the tests play the gateway)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from kvindex.settings import RedisSettings
from kvroute.devstack.embedded_redis import RedisServer
from router.epp.server import RunningEpp, running_epp
from router.epp.settings import EppSettings
from router.settings import RouterSettings
from tests.e2e.router.conftest import fleet, redis_server  # noqa: F401 (fixtures)
from tests.support import SimFleet, wait_for_workers


def epp_settings(redis_url: str, **router: object) -> EppSettings:
    options = {"redis_timeout_s": 2.0, "enable_debug": True, **router}
    return EppSettings(RouterSettings(redis=RedisSettings(url=redis_url), port=0, **options), "127.0.0.1", 0)


@pytest.fixture
async def epp(fleet: SimFleet, redis_server: RedisServer) -> AsyncIterator[RunningEpp]:  # noqa: F811
    async with running_epp(epp_settings(redis_server.url)) as running:
        await wait_for_workers(running.router, fleet.count)
        yield running


@pytest.fixture
async def channel(epp: RunningEpp) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(epp.grpc_target) as opened:
        yield opened
