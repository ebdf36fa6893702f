"""The router's client to the workers on aiohttp's client (``--upstream-client aiohttp``), beside
:mod:`router.upstream.pool` (issue 56: the design card asks for aiohttp, and the client is measured
against it again).

The same contract as :class:`~router.upstream.pool.UpstreamPool`: POST a body, get the reply once
its status and headers are in, read it whole or as it comes, ``close()`` to hand the connection
back (or close it when the reply was not read to its end, so the engine aborts the request); the
same limits (``--upstream-connections``, ``--upstream-connections-per-worker``: aiohttp's
``limit`` and ``limit_per_host``) and timeouts; failures raised as the proxy expects them
(OSError or TimeoutError before a reply, :class:`UpstreamBroken` during one). aiohttp adds no
``Accept-Encoding`` here (a worker must not compress for a client that did not ask), follows no
redirect and decompresses nothing. Requests waiting for a connection are counted through aiohttp's
trace hooks (``kvroute_router_upstream_queued``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable

import aiohttp
from multidict import CIMultiDict

from router.upstream.http1 import Reply, UpstreamBroken
from router.upstream.pool import IDLE_KEEP_S, UpstreamPool

SKIPPED = ("Accept-Encoding", "Accept", "User-Agent", "Content-Type")  # only what the client sent goes on


class AiohttpUpstreamReply(Reply):
    """A worker's reply read through aiohttp's client response."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status = response.status
        self.headers = CIMultiDict(response.headers)
        self.content_length = response.content_length
        self.answered = True
        self.complete = False

    def close(self) -> None:
        """Back to aiohttp's pool when read to its end, else the connection closed."""
        if self._response.content.at_eof():
            self._response.release()
        else:
            self._response.close()

    async def headers_read(self) -> None:
        return None  # aiohttp hands the response over with its headers in

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.iter_any()])

    async def iter_any(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except aiohttp.ClientPayloadError as exc:
            raise UpstreamBroken(f"the reply broke off ({type(exc).__name__})") from None
        except aiohttp.ClientConnectionError as exc:
            raise UpstreamBroken(f"the worker closed the connection early ({type(exc).__name__})") from None
        self.complete = True


class AiohttpPool(UpstreamPool):
    """:class:`UpstreamPool`'s contract on an ``aiohttp.ClientSession``."""

    def __init__(self, limit: int, limit_per_worker: int, connect_timeout_s: float, read_timeout_s: float) -> None:
        super().__init__(limit, limit_per_worker, connect_timeout_s, read_timeout_s)
        self._limits = limit, limit_per_worker
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s)
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        """The session, made at the first request (it needs the running loop)."""
        if self._session is None:
            limit, per_worker = self._limits
            connector = aiohttp.TCPConnector(limit=limit, limit_per_host=per_worker, keepalive_timeout=IDLE_KEEP_S)
            tracing = aiohttp.TraceConfig()
            tracing.on_connection_queued_start.append(self._queued_start)
            tracing.on_connection_queued_end.append(self._queued_end)
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=self._timeout,
                skip_auto_headers=SKIPPED,
                auto_decompress=False,
                trace_configs=[tracing],
            )
        return self._session

    async def _queued_start(self, *_: object) -> None:
        self.queued += 1

    async def _queued_end(self, *_: object) -> None:
        self.queued -= 1

    async def post(self, url: str, body: bytes, headers: Iterable[tuple[str, str]]) -> Reply:
        """POST ``body`` to ``url``; raises OSError (ConnectionRefusedError when refused) or
        TimeoutError when no reply came."""
        session = self._open()
        try:
            response = await session.post(url, data=body, headers=CIMultiDict(headers), allow_redirects=False)
        except aiohttp.ClientConnectorError as exc:
            refused = isinstance(exc.os_error, ConnectionRefusedError)
            raise (exc.os_error if refused else ConnectionError(str(exc))) from None
        except aiohttp.ClientError as exc:
            raise ConnectionError(f"the exchange failed ({type(exc).__name__})") from None
        return AiohttpUpstreamReply(response)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
