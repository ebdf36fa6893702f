"""Fixtures of the fault suite: the router tests' private Redis (one per test: scenarios kill it).
Scenes (engines, agents, routers, traffic) are opened by each test with
:func:`tests.e2e.faults.measure.open_scene`, whose arguments differ per scenario."""

from __future__ import annotations

from tests.e2e.router.conftest import redis_server

__all__ = ["redis_server"]
