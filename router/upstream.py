"""The router's HTTP client to the workers: bounded connections, no redirects, no decompression.

The connector holds at most ``--upstream-connections`` connections, ``--upstream-connections-per-
worker`` of them to one worker; a request past either waits for one (``kvroute_router_upstream_
queued`` counts those waiting), so a burst cannot open thousands of sockets to one engine.
"""

from __future__ import annotations

import aiohttp

from router.settings import RouterSettings


class UpstreamWaits:
    """Requests waiting for a connection to a worker now (the connector's limits are reached).

    Read from the connector's own queue when the metrics are scraped: a trace config (aiohttp's
    public hook for it) makes every request build and send seven trace events, ~27 us of the
    router's CPU per request for a gauge read a few times a minute. ``tests/e2e/router/
    test_limits.py`` checks the figure, so an aiohttp that renames its queue fails there."""

    def __init__(self) -> None:
        self._connector: aiohttp.BaseConnector | None = None

    def watch(self, connector: aiohttp.BaseConnector) -> None:
        self._connector = connector

    @property
    def queued(self) -> int:
        waiters = getattr(self._connector, "_waiters", None) or {}
        return sum(len(keyed) for keyed in waiters.values())


def upstream_session(settings: RouterSettings, waits: UpstreamWaits) -> aiohttp.ClientSession:
    timeout = aiohttp.ClientTimeout(total=None, connect=settings.connect_timeout_s, sock_read=settings.read_timeout_s)
    connector = aiohttp.TCPConnector(
        limit=settings.upstream_connections, limit_per_host=settings.upstream_connections_per_worker
    )
    # auto_decompress=False: a reply's bytes go to the client as the worker sent them, with their
    # Content-Encoding (router.proxy keeps that header).
    waits.watch(connector)
    return aiohttp.ClientSession(timeout=timeout, connector=connector, auto_decompress=False)
