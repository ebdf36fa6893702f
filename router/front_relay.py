"""Requests to the router's other endpoints, passed from the lean front to aiohttp's server.

A client's connection stays on the lean front whatever it asks: a probe, a scrape or a models
list on a pooled connection (a load balancer's, an SDK's) must not move that connection's later
completions to the slower server for good. Such a request, without a body, goes as sent to
aiohttp's server on a private Unix socket (kept connections, ~25 us of parsing with llhttp), and
its reply comes back framed for the client: aiohttp's middleware, routes and errors answer it
exactly as they answer a request sent to them directly.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from functools import partial
from typing import TYPE_CHECKING

from multidict import CIMultiDict

from router.front_wire import encode_head
from router.http1 import Http1Connection, Reply, UpstreamBroken
from router.proxy import HOP_BY_HOP

if TYPE_CHECKING:
    from router.front import FrontConnection

IDLE_KEEP_S = 4.0  # well under aiohttp's keep-alive time: it never closes one as a request goes out
MAX_IDLE = 64  # kept connections to aiohttp's server, at most
NO_BODY = frozenset({204, 304})
DROPPED = HOP_BY_HOP | {"content-length"}  # framed again for the client's hop


class InternalHop:
    """Connections to aiohttp's server on ``path`` (a Unix socket), kept between requests."""

    def __init__(self, path: str, read_timeout_s: float) -> None:
        self.path = path
        self._read_timeout_s = read_timeout_s
        self._idle: deque[Http1Connection] = deque()

    async def relay(self, head: bytes, out: FrontConnection, keep_alive: bool) -> None:
        """Send ``head`` (a whole request without a body) and write the reply to ``out`` as it
        comes, with ``Connection: close`` unless ``keep_alive``."""
        reply = await self._exchange(head)
        try:
            headers = CIMultiDict((k, v) for k, v in reply.headers.items() if k.lower() not in DROPPED)
            if reply.status in NO_BODY:
                out.write(encode_head(reply.status, headers, b"", keep_alive))
                return
            length = reply.content_length
            framing = b"Content-Length: %d\r\n" % length if length is not None else b"Transfer-Encoding: chunked\r\n"
            out.write(encode_head(reply.status, headers, framing, keep_alive))
            async for chunk in reply.iter_any():
                if length is not None:
                    out.write(chunk)
                elif chunk:
                    out.write(b"%x\r\n" % len(chunk), chunk, b"\r\n")
                await out.drain()
            if length is None:
                out.write(b"0\r\n\r\n")
        finally:
            reply.close()

    async def close(self) -> None:
        while self._idle:
            self._idle.pop().close()

    async def _exchange(self, head: bytes, reuse: bool = True) -> Reply:
        kept = self._kept() if reuse else None
        connection = kept or await self._connect()
        reply = connection.send(head, b"", self._read_timeout_s, partial(self._done, connection))
        try:
            await reply.headers_read()
        except UpstreamBroken:
            reply.close()
            if kept is not None and not reply.answered:  # closed as the request went out: once more
                return await self._exchange(head, reuse=False)
            raise
        except BaseException:
            reply.close()
            raise
        return reply

    def _kept(self) -> Http1Connection | None:
        now = time.monotonic()
        while self._idle:
            connection = self._idle.pop()
            if not connection.lost and now - connection.idle_since < IDLE_KEEP_S:
                return connection
            connection.close()
        return None

    async def _connect(self) -> Http1Connection:
        loop = asyncio.get_running_loop()
        _, connection = await loop.create_unix_connection(Http1Connection, self.path)
        return connection

    def _done(self, connection: Http1Connection) -> None:
        if connection.finished() and len(self._idle) < MAX_IDLE:
            self._idle.append(connection)
        else:
            connection.close()
