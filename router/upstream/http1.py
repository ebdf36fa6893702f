"""One HTTP/1.1 connection to a worker: a request written, its reply read, the connection kept.

The proxy needs little of an HTTP client: POST a body, read the status and headers, hand on the
reply's bytes as they come (no redirect followed, nothing decompressed), keep the connection for
the next request. aiohttp's client did it in ~150-190 us of CPU per request on the router's
machine, ~10% of a routed request's whole CPU; this does it in ~25 us: the request's bytes go out
in one ``writelines``, the reply is parsed by llhttp (``httptools``, the parser uvicorn uses, which
also undoes chunked framing), and each piece of the body goes to the waiting reader.

A reply is read under the read timeout (from the request sent to its first byte, and between
pieces), as aiohttp's ``sock_read`` was. A reply whose reader falls behind by ``HIGH_WATER``
bytes (a slow client of a stream) stops reading from the worker until it catches up.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import cast

import httptools
from multidict import CIMultiDict

from kvservice.deadlines import Deadlines

HIGH_WATER = 1 << 20  # reply bytes held for a slow reader before the worker's socket is paused


class UpstreamBroken(ConnectionError):
    """The worker's connection ended, or sent something that is not HTTP, before the reply ended."""


class Reply:
    """One reply from a worker: status and headers, then the body as it comes."""

    def __init__(
        self, connection: Http1Connection, read_timeout_s: float, deadlines: Deadlines, on_close: Callable[[], None]
    ) -> None:
        self._connection = connection
        self._read_timeout_s = read_timeout_s
        self._deadlines = deadlines
        self._on_close: Callable[[], None] | None = on_close
        self.status = 0
        self.headers: CIMultiDict[str] = CIMultiDict()
        self.content_length: int | None = None
        self.complete = False  # the whole reply was read off the connection
        self.keep_alive = False
        self.answered = False  # any byte of it came in
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._headed = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None

    def close(self) -> None:
        """Done with the reply: its connection goes back to the pool if the reply was read to its
        end, else it is closed (so an engine stops a stream nobody reads)."""
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()

    async def headers_read(self) -> None:
        while not self._headed:
            await self._wait()

    async def read(self) -> bytes:
        """The whole body."""
        return b"".join([chunk async for chunk in self.iter_any()])

    async def iter_any(self) -> AsyncIterator[bytes]:
        """The body's pieces as they come."""
        while True:
            if self._chunks:
                chunk = self._chunks.popleft()
                self._buffered -= len(chunk)
                if self._buffered < HIGH_WATER // 2:
                    self._connection.resume_reading()
                yield chunk
            elif self.complete:
                return
            else:
                await self._wait()

    async def _wait(self) -> None:
        if self._error is not None:
            raise self._error
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        # Not asyncio.timeout: an event-loop timer per wait was ~2% of a request's CPU (kvservice.deadlines).
        deadline = self._deadlines.later(self._read_timeout_s, self._timed_out)
        try:
            await waiter
        finally:
            deadline.cancel()
            self._waiter = None
        if self._error is not None:
            raise self._error

    def _timed_out(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(TimeoutError(f"no reply from the worker for {self._read_timeout_s:g} s"))

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # --- fed by the connection --------------------------------------------------------------

    def got_headers(self, status: int, headers: CIMultiDict[str]) -> None:
        self.status, self.headers, self._headed = status, headers, True
        length = headers.get("Content-Length")
        self.content_length = int(length) if length is not None and length.isdigit() else None
        self._wake()

    def got_body(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        self._buffered += len(chunk)
        if self._buffered > HIGH_WATER:
            self._connection.pause_reading()
        self._wake()

    def got_end(self, keep_alive: bool) -> None:
        self.complete, self.keep_alive = True, keep_alive
        self._wake()

    def failed(self, error: BaseException) -> None:
        if not self.complete and self._error is None:
            self._error = error
            self._wake()


class Http1Connection(asyncio.Protocol):
    """The connection's side of the exchanges: bytes in, callbacks of the parser, one reply at
    a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self.idle_since = time.monotonic()
        self._parser = httptools.HttpResponseParser(self)
        self._reply: Reply | None = None
        self._header_list: list[tuple[bytes, bytes]] = []
        self._informational = False  # a 1xx reply: skipped, the real one follows
        self._paused = False

    def send(
        self, head: bytes, body: bytes, read_timeout_s: float, deadlines: Deadlines, on_close: Callable[[], None]
    ) -> Reply:
        """Write a request; its reply, to be read (``on_close``: when its reader is done with it;
        ``deadlines``: where its read timeouts are set)."""
        assert self.transport is not None and self._reply is None
        reply = self._reply = Reply(self, read_timeout_s, deadlines, on_close)
        if self.lost:  # closed by the worker since it was checked
            reply.failed(UpstreamBroken("the worker closed the connection before the request was sent"))
        else:
            self.transport.writelines((head, body))
        return reply

    def finished(self) -> bool:
        """Whether the exchange under way is over and the connection can carry another."""
        reply = self._reply
        if reply is None or not reply.complete or not reply.keep_alive or self.lost:
            return False
        self._reply = None
        self.idle_since = time.monotonic()
        return True

    def close(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.close()

    def pause_reading(self) -> None:
        if not self._paused and self.transport is not None and not self.lost:
            self._paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._paused and self.transport is not None and not self.lost:
            self._paused = False
            self.transport.resume_reading()

    # --- asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is one, not a subclass

    def data_received(self, data: bytes) -> None:
        if self._reply is not None:
            self._reply.answered = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._broken(f"the worker's reply is not valid HTTP/1.1 ({exc})")

    def eof_received(self) -> bool:
        return False  # the transport closes itself; connection_lost ends the reply

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        reply = self._reply
        if reply is None or reply.complete:
            return
        if (
            reply.status
            and reply.content_length is None
            and "chunked" not in reply.headers.get("Transfer-Encoding", "")
        ):
            reply.got_end(keep_alive=False)  # a body that ends with the connection (no length given)
        else:
            reply.failed(UpstreamBroken("the worker closed the connection before its reply ended"))

    def _broken(self, why: str) -> None:
        if self._reply is not None:
            self._reply.failed(UpstreamBroken(why))
        self.close()

    # --- httptools callbacks ----------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._header_list = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_list.append((name, value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        self._informational = status < 200
        if self._informational or self._reply is None:
            return
        # As aiohttp decodes them, so that the client gets back the bytes the worker sent.
        headers = CIMultiDict(
            (name.decode("utf-8", "surrogateescape"), value.decode("utf-8", "surrogateescape"))
            for name, value in self._header_list
        )
        self._reply.got_headers(status, headers)

    def on_body(self, chunk: bytes) -> None:
        if self._reply is not None and not self._informational:
            self._reply.got_body(chunk)

    def on_message_complete(self) -> None:
        if self._informational:
            self._informational = False
            return
        if self._reply is not None:
            self._reply.got_end(self._parser.should_keep_alive())
        else:  # a reply nobody asked for: the connection cannot be trusted any more
            self.close()
