"""Requests to the router's other endpoints, passed from the lean front to aiohttp's server.

A client's connection stays on the lean front whatever it asks: a probe, a scrape or a models
list on a pooled connection (a load balancer's, an SDK's) must not move that connection's later
completions to the slower server for good. Such a request, without a body, goes as sent to
aiohttp's server on a private Unix socket (through the pool of the connections to the workers,
at most 64 at once), and its reply comes back framed for the client: aiohttp's middleware,
routes and errors answer it exactly as they answer a request sent to them directly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from multidict import CIMultiDict

from router.front_wire import encode_head
from router.proxy import HOP_BY_HOP
from router.upstream import UpstreamPool

if TYPE_CHECKING:
    from router.front import FrontConnection

MAX_CONNECTIONS = 64  # to aiohttp's server, at most; more relayed requests at once wait for one
NO_BODY = frozenset({204, 304})
DROPPED = HOP_BY_HOP | {"content-length"}  # framed again for the client's hop


class InternalHop:
    """Connections to aiohttp's server on ``path`` (a Unix socket), kept between requests (the
    pool of the connections to the workers, :class:`router.upstream.UpstreamPool`)."""

    def __init__(self, path: str, connect_timeout_s: float, read_timeout_s: float) -> None:
        self._origin = ("unix", path, 0)
        self._pool = UpstreamPool(0, MAX_CONNECTIONS, connect_timeout_s, read_timeout_s)

    async def relay(self, head: bytes, out: FrontConnection, keep_alive: bool) -> None:
        """Send ``head`` (a whole request without a body) and write the reply to ``out`` as it
        comes, with ``Connection: close`` unless ``keep_alive``."""
        reply = await self._pool.send(self._origin, head, b"")
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
        await self._pool.close()
