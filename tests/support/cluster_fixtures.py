"""Cluster fixtures: a private Redis (or Valkey) Cluster on free ports, started by the tests.

Register in tests/conftest.py with ``from tests.support.cluster_fixtures import redis_cluster  # noqa: F401``
(or list this module in ``pytest_plugins`` there).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvroute.devstack.embedded_cluster import LocalCluster


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[LocalCluster]:
    """Three masters with a replica each, of the default server binary, shared by the whole
    session: tests that fail over or kill nodes start their own LocalCluster instead."""
    cluster = LocalCluster().start()
    yield cluster
    cluster.stop()
