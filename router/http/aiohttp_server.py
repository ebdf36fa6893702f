"""The router's endpoints served by aiohttp's low-level server (``aiohttp.web.Server``), beside
:mod:`router.http.server` (``--http-server aiohttp``; issue 56: the design card asks for aiohttp
routers, and the case against aiohttp was measured against ``web.Application`` only).

The same route table, handlers and edge rules (:mod:`router.http.edges`): the route (404, 405),
the API key (401), the in-flight limit (429), the body's size (413, announced or as it comes), the
body timeout (408). aiohttp parses the requests (llhttp, as the built-in server) and frames the
replies; a handler's :class:`AiohttpReply` writes through aiohttp's response objects instead of to
the socket. What differs from the built-in server: the header timeout is aiohttp's keep-alive
timeout (a slow head is not timed), and a refused request's body is left to aiohttp (it reads and
drops it) rather than the connection closed at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping

from aiohttp import web
from multidict import CIMultiDict

from router.http.edges import (
    CLIENT_GONE,
    PROTECTED_PREFIXES,
    UNMATCHED,
    Admission,
    ApiError,
    check_key,
    internal_error,
    log_access,
    reply_broke_off,
    request_id,
)
from router.http.routes import Routes
from router.http.server import SHUTDOWN_TIMEOUT_S, ServerRules
from router.http.wire import Handler, HttpRequest, Reply, error_parts
from router.upstream.http1 import UpstreamBroken

READ_CHUNK = 64 << 10


class _NoWire:
    """:class:`AiohttpReply` writes through aiohttp's response objects, never to a wire."""

    def write(self, *pieces: bytes) -> None:
        raise RuntimeError("an aiohttp reply has no wire")

    async def drain(self) -> None:
        raise RuntimeError("an aiohttp reply has no wire")


class AiohttpReply(Reply):
    """A handler's reply as aiohttp's response objects: a whole :class:`web.Response`, or a
    :class:`web.StreamResponse` written as it comes (aiohttp frames it: chunked for HTTP/1.1)."""

    def __init__(self, request: web.BaseRequest) -> None:
        super().__init__(_NoWire(), keep_alive=True)
        self._request = request
        self.response: web.StreamResponse | None = None

    async def send_whole(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        self._begin(status)
        self.response = web.Response(status=status, body=body, headers=_safe(headers))
        self.ended = True

    async def start(self, status: int, headers: Mapping[str, str]) -> None:
        self._begin(status)
        response = web.StreamResponse(status=status, headers=_safe(headers))
        self.response = response
        await response.prepare(self._request)

    async def write(self, chunk: bytes) -> None:
        if chunk and self.response is not None:
            await self.response.write(chunk)

    async def end(self) -> None:
        if self.response is not None:
            await self.response.write_eof()
        self.ended = True

    def failed(self, exc: ApiError) -> web.StreamResponse:
        """The error's reply, unless a streamed reply was under way: then only dropping the
        connection tells the client it is cut short."""
        if self.response is not None and self.response.prepared:
            if self._request.transport is not None:
                self._request.transport.close()
            return self.response
        self.send_error(exc)
        assert self.response is not None
        return self.response

    def send_error(self, exc: ApiError) -> None:
        self._begin(exc.status)
        headers, body = error_parts(exc)
        self.response = web.Response(status=exc.status, body=body, headers=headers)
        self.ended = True


def _safe(headers: Mapping[str, str]) -> CIMultiDict[str]:
    """``headers`` without a value or name holding a line break (one could split the reply)."""
    return CIMultiDict((name, value) for name, value in headers.items() if not any(c in name + value for c in "\r\n"))


class AiohttpServer:
    """The listening socket and aiohttp's low-level server, with :class:`HttpServer`'s interface."""

    def __init__(
        self, rules: ServerRules, routes: Routes, admission: Admission, count: Callable[[str, int], None]
    ) -> None:
        self.rules, self.routes, self.admission, self.count = rules, routes, admission, count
        self._server = web.Server(self._handle, access_log=None, keepalive_timeout=rules.header_timeout_s)
        self._runner = web.ServerRunner(self._server, handle_signals=False)

    async def start(self, host: str, port: int, reuse_port: bool) -> int:
        """Listen; the port bound (``port`` 0: a free one)."""
        await self._runner.setup()
        site = web.TCPSite(
            self._runner, host, port, reuse_port=reuse_port or None, backlog=1024, shutdown_timeout=SHUTDOWN_TIMEOUT_S
        )
        await site.start()
        return int(self._runner.addresses[0][1])

    async def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        await self._runner.cleanup()

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        started = time.perf_counter()
        rid = request_id(request.headers)
        reply = AiohttpReply(request)
        fields: dict[str, object] = {}
        handler: Handler | None = None
        admitted, status = False, 500
        try:
            handler = self.routes.find(request.method, request.path)
            check_key(request.headers, request.path, self.rules.edges)
            if request.path.startswith(PROTECTED_PREFIXES):
                self.admission.enter()
                admitted = True
            body = await self._body(request)
            incoming = HttpRequest(
                request.method, request.path, request.query_string, CIMultiDict(request.headers), body, rid
            )
            fields = incoming.log_fields
            await handler(incoming, reply)
            status = reply.status
        except asyncio.CancelledError:
            status = CLIENT_GONE
            raise
        except (UpstreamBroken, TimeoutError) as exc:  # the worker's reply broke off or stalled after it began
            status = 502
            return reply.failed(reply_broke_off(rid, exc))
        except ConnectionError:  # the client went away: no reply can reach it
            status = CLIENT_GONE
            raise
        except ApiError as exc:
            status = exc.status
            return reply.failed(exc)
        except Exception:
            return reply.failed(internal_error(request.method, request.path, rid))
        finally:
            if admitted:
                self.admission.leave()
            self.count(request.path if handler is not None else UNMATCHED, status)
            log_access(
                request.method, request.path, status, time.perf_counter() - started, {"request_id": rid, **fields}
            )
        assert reply.response is not None, f"the handler of {request.path} sent no reply"
        return reply.response

    async def _body(self, request: web.BaseRequest) -> bytes:
        """The whole body, refused past the size limit (announced or as it comes) and the body timeout."""
        limit = self.rules.edges.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise ApiError(413, f"the request body exceeds {limit} bytes")
        pieces: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.rules.edges.body_timeout_s):
                while chunk := await request.content.read(READ_CHUNK):
                    size += len(chunk)
                    if size > limit:
                        raise ApiError(413, f"the request body exceeds {limit} bytes")
                    pieces.append(chunk)
        except TimeoutError:
            timeout = self.rules.edges.body_timeout_s
            raise ApiError(408, f"the request body did not arrive within {timeout:g} s") from None
        return b"".join(pieces)
