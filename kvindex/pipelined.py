"""A pipelined connection to one Redis server for script calls: replies are read as they come.

redis-py reads a command's replies in the task that sent it, so a caller that stops waiting (a
decision past its budget) must close the connection, or the next command would read its reply.
Here an asyncio protocol reads every reply and hands it to the request it answers (requests
answer in the order they were written), whoever still waits for it: a caller that gives up
abandons its future, its reply is read and dropped, and the connection stays in use. So the
requests of many concurrent callers share one connection, each written in one ``write``.

The connection is set up by redis-py itself (a connection of the client's own class and
settings: TCP or unix socket, TLS, AUTH or HELLO, SELECT, client name, RESP version), then its
socket is taken over. Replies are parsed by a ``hiredis.Reader`` made as redis-py makes it, so
values and error classes (``NoScriptError``...) are the ones redis-py would give.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import hiredis
from redis.asyncio.connection import AbstractConnection, Connection, SSLConnection, UnixDomainSocketConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

# The connection classes whose set-up is known to leave a plain asyncio stream to take over.
SUPPORTED_CONNECTIONS = (Connection, SSLConnection, UnixDomainSocketConnection)
_NOT_ENOUGH_DATA = object()
_PUSH = getattr(hiredis, "PushNotification", None)  # RESP3 out-of-band messages (hiredis >= 3.2)


class WireWatch:
    """A caller's requests still on the wire: ``on_settled`` is called once every reply has been
    read (or its connection lost), even when the caller stopped waiting long before."""

    def __init__(self) -> None:
        self.pending = 0
        self.on_settled: Callable[[], None] | None = None

    def sent(self) -> None:
        self.pending += 1

    def read(self) -> None:
        self.pending -= 1
        if self.pending == 0 and self.on_settled is not None:
            settled, self.on_settled = self.on_settled, None
            settled()


# Set by a caller that wants to know when the replies of the requests it sends are read.
wire_watch: ContextVar[WireWatch | None] = ContextVar("kvroute_wire_watch", default=None)


@dataclass(slots=True)
class _Request:
    future: asyncio.Future[list[Any]]
    count: int
    sent_at: float
    watch: WireWatch | None
    replies: list[Any] = field(default_factory=list)

    def settle(self, error: Exception | None = None) -> None:
        if not self.future.done():  # else abandoned: the reply is dropped
            if error is None:
                self.future.set_result(self.replies)
            else:
                self.future.set_exception(error)
        if self.watch is not None:
            self.watch.read()


class _Link(asyncio.Protocol):
    """One connected socket: requests written in order, replies handed out in the same order."""

    def __init__(self, writer: asyncio.StreamWriter, reader: hiredis.Reader, reply_timeout_s: float | None) -> None:
        self._writer = writer  # kept: a collected StreamWriter may close its transport (3.13+)
        self._transport = writer.transport
        self._reader = reader
        self._reply_timeout_s = reply_timeout_s
        self._pending: deque[_Request] = deque()
        self._deadline: asyncio.TimerHandle | None = None
        self.loop = asyncio.get_running_loop()
        self.closed = False

    def send(self, commands: list[bytes], request: _Request) -> None:
        if self.closed or self._transport.is_closing():
            raise RedisConnectionError("the pipelined Redis connection is closed")
        self._transport.write(b"".join(commands))
        self._pending.append(request)
        if request.watch is not None:
            request.watch.sent()
        if self._reply_timeout_s is not None and self._deadline is None:
            self._deadline = asyncio.get_running_loop().call_at(request.sent_at + self._reply_timeout_s, self._overdue)

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        while not self.closed:
            try:
                reply = self._reader.gets()
            except hiredis.ProtocolError as exc:
                self.fail(RedisConnectionError(f"Redis sent what is not RESP: {exc}"))
                return
            if reply is _NOT_ENOUGH_DATA:
                return
            if _PUSH is not None and isinstance(reply, _PUSH):
                continue  # not a reply to any request (redis-py drops these too)
            if not self._pending:
                self.fail(RedisConnectionError("Redis sent a reply no request asked for"))
                return
            request = self._pending[0]
            request.replies.append(reply)
            if len(request.replies) == request.count:
                self._pending.popleft()
                request.settle()

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(
            RedisConnectionError(f"Connection closed by server ({exc})" if exc else "Connection closed by server.")
        )

    def _overdue(self) -> None:
        """The oldest request's reply is later than the reply timeout: the server is taken for
        gone (what redis-py's socket timeout does), else the check moves to the next deadline."""
        self._deadline = None
        if not self._pending or self.closed:
            return
        due = self._pending[0].sent_at + self._reply_timeout_s  # type: ignore[operator]
        loop = asyncio.get_running_loop()
        if loop.time() >= due:
            self.fail(RedisTimeoutError(f"no reply from Redis within {self._reply_timeout_s} s"))
        else:
            self._deadline = loop.call_at(due, self._overdue)

    def fail(self, error: Exception) -> None:
        """Close the socket; every request waiting for a reply fails with ``error``."""
        self.closed = True
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._transport.close()
        while self._pending:
            self._pending.popleft().settle(error)


class PipelinedConnection:
    """Requests (each a list of packed commands and how many replies they get) on one shared
    connection to a single Redis server, connected on first use and again after a loss."""

    def __init__(self, make_connection: Callable[[], AbstractConnection], reply_timeout_s: float | None) -> None:
        self._make_connection = make_connection
        self._reply_timeout_s = reply_timeout_s
        self._packer = make_connection()  # never connected: redis-py's encoder for pack_command
        self._link: _Link | None = None
        self._connecting: asyncio.Future[_Link] | None = None

    @classmethod
    def for_client(cls, client: Any) -> PipelinedConnection | None:
        """One beside ``client`` (a redis-py asyncio ``Redis``), with its settings; None where its
        connections are of a kind this does not know how to take over (then use the client)."""
        pool = getattr(client, "connection_pool", None)
        return cls._for(getattr(pool, "connection_class", None), getattr(pool, "connection_kwargs", {}))

    @classmethod
    def for_node(cls, node: Any) -> PipelinedConnection | None:
        """One to a Redis Cluster node (redis-py's asyncio ``ClusterNode``), with the settings of
        the node's own connections (READONLY on connecting where the client reads replicas)."""
        return cls._for(getattr(node, "connection_class", None), getattr(node, "connection_kwargs", {}))

    @classmethod
    def _for(cls, kind: Any, connection_kwargs: dict[str, Any]) -> PipelinedConnection | None:
        if kind not in SUPPORTED_CONNECTIONS:
            return None
        options = dict(connection_kwargs)
        # The takeover reads redis-py's private stream fields: a redis-py without them (a later
        # release) falls back to the client's own path rather than failing every call.
        if not all(hasattr(kind(**options), field) for field in ("_writer", "_reader", "_parser")):
            return None
        # No socket timeout (the router bounds each decision itself): a pending reply later than
        # the connect timeout still means the server is gone.
        timeout = options.get("socket_timeout") or options.get("socket_connect_timeout")
        return cls(lambda: kind(**options), timeout)

    def pack_command(self, *args: Any) -> list[bytes]:
        return self._packer.pack_command(*args)

    async def execute(self, commands: list[bytes], count: int) -> list[Any]:
        """The ``count`` replies to ``commands``, error replies as exception objects. Cancelling
        the wait is safe: the replies are read and dropped. A lost connection raises redis-py's
        ``ConnectionError`` (the next call connects again); no reply within the socket timeout
        closes the connection and raises its ``TimeoutError``."""
        if count == 0:
            return []  # nothing would ever answer it
        sent = self.send_now(commands, count)
        if sent is not None:
            return await sent
        return await self._send(await self._connected(), commands, count)

    def send_now(self, commands: list[bytes], count: int) -> asyncio.Future[list[Any]] | None:
        """:meth:`execute`'s request sent at once on a connection already open, its replies'
        future returned (many connections' requests then wait together, with no task each);
        None where the connection must be opened first (then use :meth:`execute`)."""
        link = self._link
        if count == 0 or link is None or link.closed or link.loop is not asyncio.get_running_loop():
            return None  # (a socket of another loop is left alone)
        return self._send(link, commands, count)

    @staticmethod
    def _send(link: _Link, commands: list[bytes], count: int) -> asyncio.Future[list[Any]]:
        request = _Request(link.loop.create_future(), count, link.loop.time(), wire_watch.get())
        link.send(commands, request)
        return request.future

    async def _connected(self) -> _Link:
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())
            self._connecting.add_done_callback(self._connect_done)
        return await asyncio.shield(self._connecting)  # a caller that gives up leaves it to the others

    def _connect_done(self, attempt: asyncio.Future[_Link]) -> None:
        self._connecting = None
        if not attempt.cancelled() and attempt.exception() is None:
            self._link = attempt.result()

    async def _connect(self) -> _Link:
        """A connection set up by redis-py (its retries included), whose socket is then read here."""
        connection = self._make_connection()
        await connection.connect()
        writer, stream = connection._writer, connection._reader
        if writer is None or stream is None or writer.transport.is_closing():
            raise RedisConnectionError("the Redis connection closed while it was set up")
        reader_options: dict[str, Any] = {}
        if connection.encoder.decode_responses:
            reader_options = {"encoding": connection.encoder.encoding, "errors": connection.encoder.encoding_errors}
        reader = hiredis.Reader(
            protocolError=hiredis.ProtocolError,
            replyError=connection._parser.parse_error,
            notEnoughData=_NOT_ENOUGH_DATA,
            **reader_options,
        )
        leftover = bytes(getattr(stream, "_buffer", b""))  # nothing is expected after the set-up
        # redis-py lets go of the socket (its disconnect() would close it) and it is read here.
        connection._parser.on_disconnect()
        connection._writer = connection._reader = None
        link = _Link(writer, reader, self._reply_timeout_s)
        writer.transport.set_protocol(link)
        if leftover:
            link.data_received(leftover)
        return link

    async def aclose(self) -> None:
        """Close the connection; requests still waiting fail with ``ConnectionError``."""
        if self._connecting is not None:
            attempt = self._connecting
            attempt.cancel()
            await asyncio.wait([attempt])  # its outcome is no one's concern any more
        link, self._link = self._link, None
        if link is not None and not link.closed and not link.loop.is_closed():
            link.fail(RedisConnectionError("the pipelined Redis connection was closed"))
