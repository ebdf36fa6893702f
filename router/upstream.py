"""The router's HTTP client to the workers: bounded connections, no redirects, no decompression.

The connector holds at most ``--upstream-connections`` connections, ``--upstream-connections-per-
worker`` of them to one worker; a request past either waits for one (``kvroute_router_upstream_
queued`` counts those waiting), so a burst cannot open thousands of sockets to one engine.
"""

from __future__ import annotations

from types import SimpleNamespace

import aiohttp

from router.settings import RouterSettings


class UpstreamWaits:
    """Requests waiting for a connection to a worker now (the connector's limits are reached)."""

    def __init__(self) -> None:
        self.queued = 0

    def trace_config(self) -> aiohttp.TraceConfig:
        trace = aiohttp.TraceConfig()
        trace.on_connection_queued_start.append(self._start)
        trace.on_connection_queued_end.append(self._end)
        return trace

    async def _start(self, _: aiohttp.ClientSession, __: SimpleNamespace, ___: object) -> None:
        self.queued += 1

    async def _end(self, _: aiohttp.ClientSession, __: SimpleNamespace, ___: object) -> None:
        self.queued -= 1


def upstream_session(settings: RouterSettings, waits: UpstreamWaits) -> aiohttp.ClientSession:
    timeout = aiohttp.ClientTimeout(total=None, connect=settings.connect_timeout_s, sock_read=settings.read_timeout_s)
    connector = aiohttp.TCPConnector(
        limit=settings.upstream_connections, limit_per_host=settings.upstream_connections_per_worker
    )
    # auto_decompress=False: a reply's bytes go to the client as the worker sent them, with their
    # Content-Encoding (router.proxy keeps that header).
    return aiohttp.ClientSession(
        timeout=timeout, connector=connector, auto_decompress=False, trace_configs=[waits.trace_config()]
    )
