"""The lean HTTP/1.1 front of the completion endpoints; every other request is aiohttp's.

Why: aiohttp's server spent ~350 us of CPU and added ~0.4-0.6 ms per proxied request on the
router's machine (docs/benchmarks.md, issue 15, run 15), most of a Python hop's cost; the two
completion endpoints are nearly all of a router's traffic. This front frames each of their
requests itself (the head up to its blank line, then ``Content-Length`` bytes), lets llhttp
(``httptools``) check the head, and writes the reply's bytes straight to the socket.

A connection starts here and stays here. A request to another endpoint without a body (a probe,
a scrape, the models list, the dashboard) is passed as sent to aiohttp's server on a private
socket and its reply relayed (:mod:`router.front_relay`). A request this front does not take at
all (a body on another endpoint, a chunked or ``Expect: 100-continue`` body, HTTP/1.0, HEAD, an
upgrade, a head llhttp refuses or one too long) hands the connection over to aiohttp's server
from that request's first byte: aiohttp serves it and the rest of the connection as it serves
every route. A hand-over happens only between requests, when the next one's bytes are all still
held here, so nothing is lost or read twice.

The edge rules are :mod:`router.middleware`'s, applied the same: the request id, the API key, the
in-flight limit (one count for both fronts), 413 past ``--max-body-bytes``, 408 for a body slower
than ``--body-timeout-s``, the header timeout as the idle keep-alive time, OpenAI-shaped errors,
the metrics and the access log. A client that goes away cancels its request (as aiohttp's
``handler_cancellation``), which closes the worker's connection: the engine aborts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from router.completions import Incoming
from router.deadlines import Deadline, Deadlines
from router.front_relay import InternalHop
from router.front_wire import HandOver, Head, LeanReply, error_reply, parse_head
from router.http1 import UpstreamBroken
from router.middleware import CLIENT_GONE, Admission, ApiError, EdgeSettings, check_key, log_access, request_id
from router.proxy import Downstream

error_log = logging.getLogger("router.errors")
log = logging.getLogger("router.front")
Serve = Callable[[Incoming, Downstream, bool], Awaitable[None]]
HELD_WHILE_BUSY = 256 << 10  # bytes of a next request read ahead while one is served; then reading pauses
LINGER_S = 2.0  # a refused body's bytes are read and dropped this long before the connection closes
SHUTDOWN_TIMEOUT_S = 60.0  # requests under way at shutdown get this long (aiohttp's own default)


@dataclass
class _Pending:
    """A request from its head on: the id it is logged under, when it began, whether it holds a
    slot of the in-flight limit."""

    head: Head
    request_id: str
    started: float
    admitted: bool = False


@dataclass(frozen=True)
class FrontRules:
    edges: EdgeSettings
    header_timeout_s: float
    routes: dict[str, bool]  # path: is it a chat


class Front:
    """The listening socket, its connections, and what they share."""

    def __init__(
        self,
        rules: FrontRules,
        serve: Serve,
        admission: Admission,
        count: Callable[[str, int], None],
        fallback: Callable[[], asyncio.Protocol],
        handed_over: Callable[[], None] = lambda: None,
        internal: InternalHop | None = None,
    ) -> None:
        self.rules, self.serve, self.admission, self.count = rules, serve, admission, count
        self.fallback = fallback  # aiohttp's connection handler, for whatever this front does not take
        self.handed_over = handed_over  # told of each connection handed over (the metrics)
        self.internal = internal  # aiohttp's server on a private socket; None: every other request hands over
        self.connections: set[FrontConnection] = set()
        self.closing = False
        self.deadlines = Deadlines()  # the connections' header and body timers, on one loop timer
        self._server: asyncio.Server | None = None
        self._all_idle = asyncio.Event()

    async def start(self, host: str, port: int, reuse_port: bool) -> int:
        """Listen; the port bound (``port`` 0: a free one)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: FrontConnection(self), host, port, reuse_port=reuse_port or None, backlog=1024
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
        # Not the server's wait_closed(): it waits for every connection accepted, those handed
        # over to aiohttp's server too, which close only when that server is cleaned up, after this.

    def gone(self, connection: FrontConnection) -> None:
        self.connections.discard(connection)
        if not self.connections:
            self._all_idle.set()


class FrontConnection(asyncio.Protocol):
    """One client connection while this front serves it: a request at a time, in order."""

    def __init__(self, front: Front) -> None:
        self.front = front
        self.transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._pending: _Pending | None = None  # a head parsed, its body still coming
        self._task: asyncio.Task[None] | None = None  # the request being served
        self._timer: Deadline | None = None
        self._lost = False
        self._eof = False
        self._read_paused = False
        self._write_paused = False
        self._drained: asyncio.Future[None] | None = None
        self._discarding = False  # a refused body's bytes are dropped until the close

    # --- asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is one, not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.front.connections.add(self)
        if self.front.closing:
            self._close()
            return
        self._arm(self.front.rules.header_timeout_s, self._close)

    def data_received(self, data: bytes) -> None:
        if self._discarding:
            return
        self._buffer += data
        if self._task is None:
            self._advance()
        elif len(self._buffer) > HELD_WHILE_BUSY:
            self._pause_reading()

    def eof_received(self) -> bool:
        self._eof = True
        return self._task is not None  # a request under way still gets its reply; then closed

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._disarm()
        if self._pending is not None:  # gone while sending the body
            pending, self._pending = self._pending, None
            self._finish(pending, CLIENT_GONE, {})
        if self._task is not None:
            self._task.cancel()  # the client went away: the worker's connection is closed, it aborts
        if self._drained is not None and not self._drained.done():
            self._drained.set_exception(ConnectionResetError("the client closed the connection"))
        self.front.gone(self)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

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

    # --- the requests -----------------------------------------------------------------------

    def close_when_idle(self) -> None:
        if self._task is None and self._pending is None:
            self._close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def _advance(self) -> None:
        """With no request under way: take the next one from the buffer, if it is all in."""
        if self._pending is None:
            if not self._buffer:
                return
            parsed = parse_head(self._buffer, self.front.rules.routes)
            if parsed is None:
                return  # more to come, under the header timer
            if isinstance(parsed, HandOver) or (parsed.passed_on and self.front.internal is None):
                self._hand_over()
                return
            if parsed.passed_on:
                del self._buffer[: parsed.end]
                self._disarm()
                self._task = asyncio.get_running_loop().create_task(self._pass_on(parsed))
                return
            self._pending = _Pending(parsed, request_id(parsed.headers), time.perf_counter())
            if not self._admit(self._pending):
                return
            if len(self._buffer) < parsed.end:  # mostly it came with its head: no timer then
                self._arm(self.front.rules.edges.body_timeout_s, self._body_late)
        pending = self._pending
        head = pending.head
        if len(self._buffer) < head.end:
            return  # the body is still coming, under the body timer
        self._disarm()
        body = bytes(memoryview(self._buffer)[head.head_length : head.end])
        del self._buffer[: head.end]
        self._pending = None
        self._task = asyncio.get_running_loop().create_task(self._serve(pending, body))

    def _admit(self, pending: _Pending) -> bool:
        """The rules read from the head, as the middleware applies them before reading a body:
        the key, the in-flight limit (held from here on, while the body comes too), the size."""
        edges = self.front.rules.edges
        try:
            check_key(pending.head.headers, pending.head.path, edges)
            self.front.admission.enter()
            pending.admitted = True
            if pending.head.length > edges.max_body_bytes:
                raise ApiError(413, f"the request body exceeds {edges.max_body_bytes} bytes")
        except ApiError as exc:
            self._refuse(exc)
            return False
        return True

    async def _serve(self, pending: _Pending, body: bytes) -> None:
        front, head = self.front, pending.head
        incoming = Incoming(head.path, head.headers, body, pending.request_id)
        reply = LeanReply(self, head.keep_alive and not front.closing)
        status = 500
        try:
            await front.serve(incoming, reply, front.rules.routes[head.path])
            status = reply.status
        except asyncio.CancelledError:
            status = CLIENT_GONE
            raise
        except (UpstreamBroken, TimeoutError) as exc:  # the worker's reply broke off or stalled after it began
            status = 502
            log.warning("request %s: the worker's reply did not end: %r", pending.request_id, exc)
            self._reply_error(reply, ApiError(502, "the worker's reply broke off", "upstream_error"))
        except ConnectionError:  # a write found the client gone: no reply can reach it
            status = CLIENT_GONE
            self._close()
        except ApiError as exc:
            status = exc.status
            self._reply_error(reply, exc)
        except Exception:
            status = 500
            self._internal_error(head, reply, incoming.request_id)
        finally:
            self._task = None
            self._finish(pending, status, incoming.log_fields)
        self._next(reply.keep_alive and reply.ended)

    async def _pass_on(self, head: Head) -> None:
        """A request to another endpoint: aiohttp's server answers it, the connection stays."""
        assert self.front.internal is not None
        keep_alive = head.keep_alive and not self.front.closing
        ended = False
        try:
            await self.front.internal.relay(head.raw, self, keep_alive)
            ended = True
        except ConnectionError:  # the client went away, or aiohttp's server broke off its reply
            self._close()
        except Exception:
            error_log.exception("internal error passing on %s to the router's own server", head.path.split("?")[0])
            self._close()
        finally:
            self._task = None
        self._next(keep_alive and ended)

    def _finish(self, pending: _Pending, status: int, fields: dict[str, Any]) -> None:
        """A request is over: its slot freed, counted, logged."""
        if pending.admitted:
            pending.admitted = False
            self.front.admission.leave()
        self.front.count(pending.head.path, status)
        fields = {"request_id": pending.request_id, **fields}
        log_access("POST", pending.head.path, status, time.perf_counter() - pending.started, fields)

    def _reply_error(self, reply: LeanReply, exc: ApiError) -> None:
        if reply.started:
            self._close()  # a reply was under way: only closing tells the client it is cut short
            return
        with contextlib.suppress(ConnectionError):  # the client went away: still counted and logged
            reply.send_error(exc)

    def _internal_error(self, head: Head, reply: LeanReply, rid: str) -> None:
        # A bug, not the client's mistake: the traceback goes to the log, once, and the client
        # gets an OpenAI-shaped 500 naming the request id to look for.
        error_log.exception("internal error on POST %s (request %s)", head.path, rid)
        message = f"internal error in the router; its log has the details under request id {rid}"
        self._reply_error(reply, ApiError(500, message, "internal_error"))

    def _next(self, keep_alive: bool) -> None:
        """A reply is done: the next request, or the close."""
        if self._lost:
            return
        if not keep_alive or self._eof or self.front.closing:
            self._close()
            return
        if self._read_paused:
            self._read_paused = False
            assert self.transport is not None
            self.transport.resume_reading()
        self._arm(self.front.rules.header_timeout_s, self._close)
        self._advance()

    def _body_late(self) -> None:
        self._timer = None
        if self._pending is not None:
            timeout = self.front.rules.edges.body_timeout_s
            self._refuse(ApiError(408, f"the request body did not arrive within {timeout:g} s"))

    def _refuse(self, exc: ApiError) -> None:
        """Answer ``exc`` before reading the pending request's body, then close: the client's
        remaining bytes are read and dropped for a while first, so that its reply is not lost to
        a reset."""
        pending, self._pending, self._discarding = self._pending, None, True
        assert pending is not None
        self._buffer.clear()
        self._disarm()
        if not self._lost:
            self.write(error_reply(exc, keep_alive=False))
            assert self.transport is not None
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self._arm(LINGER_S, self._close)
        self._finish(pending, exc.status, {})

    def _hand_over(self) -> None:
        """From here on, aiohttp's server has the connection, with the bytes not yet served."""
        transport = self.transport
        assert transport is not None and self._task is None
        self._disarm()
        self.front.gone(self)
        self.front.handed_over()
        handler = self.front.fallback()
        transport.set_protocol(handler)
        handler.connection_made(transport)
        if self._read_paused:
            transport.resume_reading()
        held, self._buffer = bytes(self._buffer), bytearray()
        if held:
            handler.data_received(held)
        if self._eof and not handler.eof_received():
            transport.close()

    def _pause_reading(self) -> None:
        if not self._read_paused and self.transport is not None and not self._lost:
            self._read_paused = True
            self.transport.pause_reading()

    def _arm(self, seconds: float, then: Callable[[], None]) -> None:
        self._disarm()
        self._timer = self.front.deadlines.later(seconds, then)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _close(self) -> None:
        self._disarm()
        if self.transport is not None:
            self.transport.close()
