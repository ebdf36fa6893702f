"""The router's HTTP/1.1 server: every endpoint, one route table, one set of edge rules.

Why not aiohttp's server: on the router's request path it spent ~0.7-1.0 ms more CPU per request
than this server and added ~0.5-0.8 ms more latency (docs/benchmarks-history.md, run 15 and "One HTTP
server"), most of a Python hop's cost. Requests are parsed by llhttp (``httptools``, the parser of
uvicorn and of aiohttp's C side), fed every byte as it comes: it frames bodies by their length or
their chunks, and refuses what request smuggling relies on (a bad or doubled ``Content-Length``,
``Content-Length`` with ``Transfer-Encoding``, obs-fold, a header name with a space, bare line
feeds), which is a 400 here and the connection's close.

A connection serves its requests one at a time, in order: pipelined requests are parsed as they
come and wait their turn (reading pauses while they hold more than ``HELD_WHILE_BUSY``). The edge
rules are applied from a request's head, before its body is read: the route (404, 405), the API
key (401), the in-flight limit (429), the body's size (413, from ``Content-Length``, or as a
chunked body grows); an ``Expect: 100-continue`` is answered once they pass. A refused request
is answered at its turn and its connection closed after a short linger (its body is not read).
Timers: the header timeout while a connection waits for a request's head (slowloris, idle
keep-alive), the body timeout (408) while it waits for a body. A client that goes away cancels
its request, which closes the worker's connection: the engine aborts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httptools
from multidict import CIMultiDict

from kvservice.deadlines import Deadline, Deadlines
from router.http.edges import (
    CLIENT_GONE,
    PROTECTED_PREFIXES,
    UNMATCHED,
    Admission,
    ApiError,
    EdgeSettings,
    check_key,
    internal_error,
    log_access,
    reply_broke_off,
    request_id,
)
from router.http.routes import Routes
from router.http.wire import Handler, HttpRequest, Reply, error_reply
from router.upstream.http1 import UpstreamBroken

log = logging.getLogger("router.http")
MAX_LINE = 8190  # the request line's target, as aiohttp's limit: longer is a 414
MAX_HEAD = 64 << 10  # the whole head: longer is a 431
HELD_WHILE_BUSY = 256 << 10  # bytes of later requests held while one is served; then reading pauses
LINGER_S = 2.0  # a refused body's bytes are read and dropped this long before the connection closes
SHUTDOWN_TIMEOUT_S = 60.0  # requests under way at shutdown get this long (aiohttp's own default)


@dataclass(frozen=True)
class ServerRules:
    edges: EdgeSettings
    header_timeout_s: float


@dataclass
class _Request:
    """A request from its first byte on."""

    started: float
    url: bytearray = field(default_factory=bytearray)
    fields: list[tuple[bytes, bytes]] = field(default_factory=list)
    head_bytes: int = 0
    method: str = ""
    path: str = ""
    query: str = ""
    headers: CIMultiDict[str] = field(default_factory=CIMultiDict)
    request_id: str = ""
    keep_alive: bool = False
    chunked_reply: bool = True  # HTTP/1.1 (else a streamed reply ends with the close)
    head_done: bool = False
    complete: bool = False
    handler: Handler | None = None
    refusal: ApiError | None = None  # answered at its turn; the connection then closes
    admitted: bool = False
    continue_due: bool = False  # Expect: 100-continue, answered when its turn comes
    body_timed: bool = False  # the body timer was armed (once: the timeout is for the whole body)
    body: list[bytes] = field(default_factory=list)
    body_bytes: int = 0


class _Stop(Exception):
    """Raised from a parser callback: the connection reads no more (a refusal answered at once)."""


class HttpServer:
    """The listening socket, its connections, and what they share."""

    def __init__(
        self, rules: ServerRules, routes: Routes, admission: Admission, count: Callable[[str, int], None]
    ) -> None:
        self.rules, self.routes, self.admission, self.count = rules, routes, admission, count
        self.connections: set[Connection] = set()
        self.closing = False
        self.deadlines = Deadlines()  # the connections' header and body timers, on one loop timer
        self._server: asyncio.Server | None = None
        self._all_idle = asyncio.Event()

    async def start(self, host: str, port: int, reuse_port: bool) -> int:
        """Listen; the port bound (``port`` 0: a free one)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: Connection(self), host, port, reuse_port=reuse_port or None, backlog=1024
        )
        return int(self._server.sockets[0].getsockname()[1])

    async def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Stop listening, close idle connections, give the requests under way ``timeout_s``."""
        self.closing = True
        if self._server is not None:
            self._server.close()
        for connection in list(self.connections):
            connection.close_when_idle()
        if self.connections:
            self._all_idle.clear()
            try:
                async with asyncio.timeout(timeout_s):
                    await self._all_idle.wait()
            except TimeoutError:
                for connection in list(self.connections):
                    connection.abort()
        if self._server is not None:
            await self._server.wait_closed()

    def gone(self, connection: Connection) -> None:
        self.connections.discard(connection)
        if not self.connections:
            self._all_idle.set()


class Connection(asyncio.Protocol):
    """One client connection: its bytes through llhttp, its requests served one at a time."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._parsing: _Request | None = None  # the request whose bytes are coming in
        self._waiting: deque[_Request] = deque()  # requests begun, in order; the first is next
        self._task: asyncio.Task[None] | None = None  # the request being served
        self._timer: Deadline | None = None
        self._lost = self._eof = self._read_paused = self._write_paused = False
        self._stopped = False  # no more bytes are parsed (a refusal, a bad request, an upgrade)
        self._lingering = False  # a refusal was sent: the client's last bytes are dropped until the close
        self._drained: asyncio.Future[None] | None = None

    # --- asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is one, not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.connections.add(self)
        if self.server.closing:
            self._close()
            return
        self._arm(self.server.rules.header_timeout_s, self._close)

    def data_received(self, data: bytes) -> None:
        if self._stopped:
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            if not isinstance(exc.__context__, _Stop):
                raise
        except httptools.HttpParserUpgrade:
            self._stopped = True  # the request is served as a plain one; what follows is not HTTP/1.1
        except httptools.HttpParserError as exc:
            self._malformed(exc)
        self._advance()
        if self._task is not None and self._held() > HELD_WHILE_BUSY:
            self._pause_reading()

    def eof_received(self) -> bool:
        """The client sent its last byte (it may still read): a request cut off in its head is
        dropped, one cut off in its body answered 400; the connection closes once the requests
        before them are answered."""
        self._eof = True
        request, self._parsing = self._parsing, None
        if request is not None and not self._stopped:
            if not request.head_done:
                self._waiting.remove(request)
            elif request.refusal is None:
                request.refusal = ApiError(400, "the request ended before its body was complete")
        self._stopped = True
        self._advance()
        return True  # half-open: the replies still go out; closed when they have

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._disarm()
        for request in self._waiting:
            if request.head_done:  # gone while sending it: counted, logged
                self._finish(request, CLIENT_GONE, {})
        self._waiting.clear()
        if self._task is not None:
            self._task.cancel()  # the client went away: the worker's connection is closed, it aborts
        if self._drained is not None and not self._drained.done():
            self._drained.set_exception(ConnectionResetError("the client closed the connection"))
        self.server.gone(self)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    # --- llhttp's callbacks -----------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._parsing = _Request(time.perf_counter())
        self._waiting.append(self._parsing)

    def on_url(self, url: bytes) -> None:
        request = self._current()
        request.url += url
        request.head_bytes += len(url)
        if len(request.url) > MAX_LINE:
            self._refuse_now(request, ApiError(414, f"the request target is longer than {MAX_LINE} bytes"))

    def on_header(self, name: bytes, value: bytes) -> None:
        request = self._current()
        request.fields.append((name, value))
        request.head_bytes += len(name) + len(value) + 4
        if request.head_bytes > MAX_HEAD:
            self._refuse_now(request, ApiError(431, f"the request's head is longer than {MAX_HEAD} bytes"))

    def on_headers_complete(self) -> None:
        request = self._current()
        parser = self._parser
        request.method = parser.get_method().decode("ascii", "replace")
        target = request.url.decode("latin-1")
        request.path, _, request.query = target.partition("?")
        request.headers = CIMultiDict(
            (name.decode("utf-8", "surrogateescape"), value.decode("utf-8", "surrogateescape"))
            for name, value in request.fields
        )
        request.request_id = request_id(request.headers)
        request.keep_alive = parser.should_keep_alive()
        version = parser.get_http_version()
        request.chunked_reply = version != "1.0"
        request.head_done = True
        try:
            if version not in ("1.0", "1.1"):
                raise ApiError(505, f"HTTP/{version} is not supported; use HTTP/1.1")
            self._admit(request)
        except ApiError as exc:
            request.refusal = exc
            # A body to come is not read: the refusal goes now and the connection closes. A
            # request without one is answered at its turn and the connection carries on.
            announced = request.headers.get("Content-Length", "0") != "0" or "Transfer-Encoding" in request.headers
            if announced and request is self._waiting[0] and self._task is None:
                self._refuse_now(request, exc)
            return
        if request.headers.get("Expect", "").lower() == "100-continue":
            request.continue_due = True
            self._continue_if_due()

    def on_body(self, body: bytes) -> None:
        request = self._current()
        if request.refusal is not None:
            return  # its reply says why; its body is not kept
        request.body.append(body)
        request.body_bytes += len(body)
        limit = self.server.rules.edges.max_body_bytes
        if request.body_bytes > limit:  # a chunked body: its size shows only as it comes
            request.refusal = ApiError(413, f"the request body exceeds {limit} bytes")
            request.body.clear()
            if request is self._waiting[0] and self._task is None:
                self._refuse_now(request, request.refusal)

    def on_message_complete(self) -> None:
        self._current().complete = True
        self._parsing = None

    def _current(self) -> _Request:
        assert self._parsing is not None
        return self._parsing

    # --- the edge rules ---------------------------------------------------------------------

    def _admit(self, request: _Request) -> None:
        """The rules read from the head: the route, the key, the in-flight limit (held from here
        on, while the body comes too), the size the head announces."""
        server, edges = self.server, self.server.rules.edges
        request.handler = server.routes.find(request.method, request.path)
        check_key(request.headers, request.path, edges)
        if request.path.startswith(PROTECTED_PREFIXES):
            server.admission.enter()
            request.admitted = True
        length = request.headers.get("Content-Length")
        if length is not None and length.isdigit() and int(length) > edges.max_body_bytes:
            raise ApiError(413, f"the request body exceeds {edges.max_body_bytes} bytes")

    def _continue_if_due(self) -> None:
        request = self._waiting[0] if self._waiting else None
        if request is not None and request.continue_due and self._task is None and not request.complete:
            request.continue_due = False
            self.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    # --- the requests, in turn --------------------------------------------------------------

    def _advance(self) -> None:
        """With no request under way: serve the next one if it is all in, answer it if it was
        refused, else wait for it under the right timer."""
        if self._task is not None or self._lost:
            return
        while self._waiting and self._waiting[0].refusal is not None and self._waiting[0].complete:
            self._answer_refused(self._waiting.popleft())
        if not self._waiting:
            if (self._stopped or self._eof) and not self._lingering:
                self._close()
            return
        request = self._waiting[0]
        if request.refusal is not None and request.head_done:
            self._refuse_now(request, request.refusal, stop=False)
            return
        if not request.complete:
            if request.head_done and not request.body_timed:
                request.body_timed = True
                self._continue_if_due()
                self._arm(self.server.rules.edges.body_timeout_s, self._body_late)
            elif self._stopped:
                self._close()  # a head that will not be finished
            return
        self._waiting.popleft()
        self._disarm()
        self._task = asyncio.get_running_loop().create_task(self._serve(request))

    async def _serve(self, request: _Request) -> None:
        incoming = HttpRequest(
            request.method,
            request.path,
            request.query,
            request.headers,
            b"".join(request.body),
            request.request_id,
        )
        reply = self._reply_for(request)
        status = 500
        try:
            assert request.handler is not None
            await request.handler(incoming, reply)
            status = reply.status
        except asyncio.CancelledError:
            status = CLIENT_GONE
            raise
        except (UpstreamBroken, TimeoutError) as exc:  # the worker's reply broke off or stalled after it began
            status = 502
            self._reply_error(reply, reply_broke_off(request.request_id, exc))
        except ConnectionError:  # a write found the client gone: no reply can reach it
            status = CLIENT_GONE
            self._close()
        except ApiError as exc:
            status = exc.status
            self._reply_error(reply, exc)
        except Exception:
            status = 500
            self._reply_error(reply, internal_error(request.method, request.path, request.request_id))
        finally:
            self._task = None
            self._finish(request, status, incoming.log_fields)
        self._next(reply.keep_alive and reply.ended)

    def _reply_for(self, request: _Request) -> Reply:
        """The request's reply: kept alive only if the client asked and the connection goes on."""
        keep_alive = request.keep_alive and not self.server.closing and not self._stopped
        return Reply(self, keep_alive, request.chunked_reply, head_only=request.method == "HEAD")

    def _finish(self, request: _Request, status: int, fields: dict[str, Any]) -> None:
        """A request is over: its slot freed, counted, logged."""
        if request.admitted:
            request.admitted = False
            self.server.admission.leave()
        # A route's path, or one label for what no route serves (a scanner makes no series).
        self.server.count(request.path if request.handler is not None else UNMATCHED, status)
        fields = {"request_id": request.request_id, **fields}
        log_access(request.method, request.path, status, time.perf_counter() - request.started, fields)

    def _reply_error(self, reply: Reply, exc: ApiError) -> None:
        if reply.started:
            self._close()  # a reply was under way: only closing tells the client it is cut short
            return
        with contextlib.suppress(ConnectionError):  # the client went away: still counted and logged
            reply.send_error(exc)

    def _next(self, keep_alive: bool) -> None:
        """A reply is done: the next request, or the close."""
        if self._lost:
            return
        if not keep_alive or self.server.closing:
            self._close()
            return
        if self._read_paused:
            self._read_paused = False
            assert self.transport is not None
            self.transport.resume_reading()
        if not self._waiting and self._eof:
            self._close()
            return
        self._arm(self.server.rules.header_timeout_s, self._close)
        self._advance()

    def _answer_refused(self, request: _Request) -> None:
        """A refused request that came whole: its error, and the connection carries on."""
        assert request.refusal is not None
        reply = self._reply_for(request)
        with contextlib.suppress(ConnectionError):
            reply.send_error(request.refusal)
        self._finish(request, request.refusal.status, {})
        if not reply.keep_alive:
            self._stopped = True
            self._waiting.clear()
            self._close()

    def _body_late(self) -> None:
        self._timer = None
        if self._task is None and self._waiting and self._waiting[0].head_done:
            timeout = self.server.rules.edges.body_timeout_s
            self._refuse_now(
                self._waiting[0], ApiError(408, f"the request body did not arrive within {timeout:g} s"), stop=False
            )

    def _refuse_now(self, request: _Request, exc: ApiError, stop: bool = True) -> None:
        """Answer ``exc`` for the request at the head of the line, before its body is read, then
        close: the client's remaining bytes are read and dropped for a while first, so that its
        reply is not lost to a reset. From a parser callback (``stop``), parsing ends here."""
        if request is not (self._waiting[0] if self._waiting else None) or self._task is not None:
            request.refusal = exc  # pipelined behind a request under way: answered at its turn
            return
        self._waiting.clear()
        self._stopped = True
        self._disarm()
        if not self._lost:
            with contextlib.suppress(ConnectionError):
                self.write(error_reply(exc, keep_alive=False))
            self._write_eof()
            self._linger()
        if request.head_done:
            self._finish(request, exc.status, {})
        if stop:
            raise _Stop

    def _malformed(self, exc: Exception) -> None:
        """llhttp refused the bytes: a 400 if no request is under way (else the close), one line
        in the log, and the connection's end."""
        self._stopped = True
        reason = str(exc).strip() or type(exc).__name__
        log.info("refused a malformed HTTP request: %s", reason)
        if self._parsing is not None and self._parsing in self._waiting:
            self._waiting.remove(self._parsing)
            if self._parsing.admitted:
                self._parsing.admitted = False
                self.server.admission.leave()
        self._parsing = None
        if self._task is None and not self._waiting and not self._lost:
            with contextlib.suppress(ConnectionError):
                self.write(error_reply(ApiError(400, f"malformed HTTP request: {reason}"), keep_alive=False))
            self._write_eof()
            self._linger()

    # --- used by the reply ------------------------------------------------------------------

    def write(self, *pieces: bytes) -> None:
        if self._lost or self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        self.transport.writelines(pieces)

    async def drain(self) -> None:
        if self._lost:
            raise ConnectionResetError("the client closed the connection")
        if self._write_paused:
            self._drained = asyncio.get_running_loop().create_future()
            try:
                await self._drained
            finally:
                self._drained = None

    # --- the connection ---------------------------------------------------------------------

    def _linger(self) -> None:
        """Close in a while (at once if the client sent its last byte): a reset now could lose
        the reply the client has not read yet."""
        if self._eof:
            self._close()
            return
        self._lingering = True
        self._arm(LINGER_S, self._close)

    def _write_eof(self) -> None:
        """Say that no more bytes come (the client reads the reply before the close's reset)."""
        transport = self.transport
        if transport is not None and not transport.is_closing() and transport.can_write_eof():
            with contextlib.suppress(OSError):  # the client is gone already
                transport.write_eof()

    def close_when_idle(self) -> None:
        if self._task is None and not any(r.head_done for r in self._waiting):
            self._close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def _held(self) -> int:
        return sum(r.body_bytes + r.head_bytes for r in self._waiting)

    def _pause_reading(self) -> None:
        if not self._read_paused and self.transport is not None and not self._lost:
            self._read_paused = True
            self.transport.pause_reading()

    def _arm(self, seconds: float, then: Callable[[], None]) -> None:
        self._disarm()
        self._timer = self.server.deadlines.later(seconds, then)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _close(self) -> None:
        self._disarm()
        if self.transport is not None:
            self.transport.close()
