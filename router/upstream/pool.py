"""The router's HTTP client to the workers: bounded keep-alive connections, no redirects, no decompression.

At most ``--upstream-connections`` connections are in use, ``--upstream-connections-per-worker``
of them to one worker; a request past either waits for one (``kvroute_router_upstream_queued``
counts those waiting), so a burst cannot open thousands of sockets to one engine. A connection
whose reply was read to its end is kept for the next request to that worker, for at most
``IDLE_KEEP_S``; one given up mid-reply is closed, which makes the engine abort the request.
One connection's exchange is :mod:`router.upstream.http1`. The prompts' ``/tokenize`` calls (models
without a local tokenizer) go through the same pool: one HTTP client stack to the workers.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial
from typing import Self
from urllib.parse import urlsplit

from kvservice.deadlines import Deadlines
from router.settings import RouterSettings
from router.upstream.http1 import Http1Connection, Reply, UpstreamBroken

# vLLM's server (uvicorn) closes a connection idle for 5 s. Dropping ours sooner means the worker
# never closes one just as a request is written on it (which would fail that request).
IDLE_KEEP_S = 4.0
MAX_TARGETS = 4096  # parsed worker URLs remembered (workers x paths)
Origin = tuple[str, str, int]  # scheme, host, port; ("unix", path, 0) for a Unix socket
Slots = tuple[asyncio.Semaphore | None, asyncio.Semaphore | None]  # the worker's, everyone's


class _ClosedWhileKept(Exception):
    """A kept connection ended before any byte of the reply: the request is sent again."""


@dataclass(frozen=True)
class _Target:
    origin: Origin
    host_header: str
    path: str


def _target(url: str) -> _Target:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL with a host: {url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return _Target((parts.scheme, parts.hostname, port), parts.netloc.rpartition("@")[2], path)


def _head(target: _Target, headers: Iterable[tuple[str, str]], length: int) -> bytes:
    lines = [f"POST {target.path} HTTP/1.1\r\nHost: {target.host_header}\r\n"]
    for name, value in headers:
        # aiohttp's parser lets no line break into a header; one that did could split the request.
        if "\n" not in value and "\r" not in value and "\n" not in name and "\r" not in name:
            lines.append(f"{name}: {value}\r\n")
    lines.append(f"Content-Length: {length}\r\n\r\n")
    return "".join(lines).encode("utf-8", "surrogateescape")


class UpstreamPool:
    def __init__(self, limit: int, limit_per_worker: int, connect_timeout_s: float, read_timeout_s: float) -> None:
        self._shared = asyncio.Semaphore(limit) if limit > 0 else None
        self._limit_per_worker = limit_per_worker
        self._own: dict[Origin, asyncio.Semaphore] = {}
        self._idle: dict[Origin, deque[Http1Connection]] = {}
        self._targets: dict[str, _Target] = {}
        self._connect_timeout_s = connect_timeout_s
        self._read_timeout_s = read_timeout_s
        self._deadlines = Deadlines()  # the replies' read timeouts, on one loop timer
        self._ssl: ssl.SSLContext | None = None
        self.queued = 0  # requests waiting for a connection now (the limits are reached)

    @classmethod
    def from_settings(cls, settings: RouterSettings) -> Self:
        return cls(
            settings.upstream_connections,
            settings.upstream_connections_per_worker,
            settings.connect_timeout_s,
            settings.read_timeout_s,
        )

    async def post(self, url: str, body: bytes, headers: Iterable[tuple[str, str]]) -> Reply:
        """POST ``body`` to ``url``; the reply once its status and headers are in. Its ``close()``
        hands the connection back (or closes it, if the reply was not read to its end).
        Raises OSError (ConnectionError: refused, reset, closed early) or TimeoutError."""
        target = self._targets.get(url)
        if target is None:
            if len(self._targets) >= MAX_TARGETS:
                self._targets.clear()
            target = self._targets[url] = _target(url)
        return await self.send(target.origin, _head(target, headers, len(body)), body)

    async def send(self, origin: Origin, head: bytes, body: bytes) -> Reply:
        """A request's ``head`` and ``body`` as they are, to ``origin`` (``("unix", path, 0)``: a
        Unix socket); the reply once its status and headers are in (as :meth:`post`)."""
        try:
            return await self._exchange(origin, head, body, reuse=True)
        except _ClosedWhileKept:
            # The worker closed a kept connection as the request went out on it, and answered
            # nothing (its keep-alive time is shorter than ours): sent once more, on a new one.
            return await self._exchange(origin, head, body, reuse=False)

    async def _exchange(self, origin: Origin, head: bytes, body: bytes, reuse: bool) -> Reply:
        slots = await self._take_slots(origin)
        try:
            kept = self._idle_connection(origin) if reuse else None
            connection = kept or await self._connect(origin)
        except BaseException:
            self._give_slots(slots)
            raise
        reply = connection.send(
            head, body, self._read_timeout_s, self._deadlines, partial(self._done, origin, connection, slots)
        )
        try:
            await reply.headers_read()
        except UpstreamBroken as exc:
            reply.close()
            if kept is not None and not reply.answered:
                raise _ClosedWhileKept from exc
            raise
        except BaseException:
            reply.close()
            raise
        return reply

    async def close(self) -> None:
        for idle in self._idle.values():
            while idle:
                idle.pop().close()

    async def _take_slots(self, origin: Origin) -> Slots:
        own = self._own.get(origin)
        if own is None and self._limit_per_worker > 0:
            own = self._own[origin] = asyncio.Semaphore(self._limit_per_worker)
        shared = self._shared
        if (own is None or not own.locked()) and (shared is None or not shared.locked()):
            await _acquire(own, shared)  # free slots: taken without waiting
            return own, shared
        self.queued += 1
        try:
            await _acquire(own, shared)
        finally:
            self.queued -= 1
        return own, shared

    @staticmethod
    def _give_slots(slots: Slots) -> None:
        for semaphore in slots:
            if semaphore is not None:
                semaphore.release()

    def _idle_connection(self, origin: Origin) -> Http1Connection | None:
        idle = self._idle.get(origin)
        now = time.monotonic()
        while idle:
            connection = idle.pop()  # the most recently used: the least likely to be closed
            if not connection.lost and now - connection.idle_since < IDLE_KEEP_S:
                return connection
            connection.close()
        return None

    async def _connect(self, origin: Origin) -> Http1Connection:
        scheme, host, port = origin
        context = None
        if scheme == "https":
            context = self._ssl = self._ssl or ssl.create_default_context()
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self._connect_timeout_s):
            if scheme == "unix":
                transport, connection = await loop.create_unix_connection(Http1Connection, host)
            else:
                transport, connection = await loop.create_connection(
                    Http1Connection, host, port, ssl=context, server_hostname=host if context else None
                )
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return connection

    def _done(self, origin: Origin, connection: Http1Connection, slots: Slots) -> None:
        """An exchange is over: its connection kept if its reply was read to its end."""
        if connection.finished():
            idle = self._idle.setdefault(origin, deque())
            idle.append(connection)
            stale_before = time.monotonic() - IDLE_KEEP_S
            while idle and idle[0].idle_since <= stale_before:
                idle.popleft().close()
        else:
            connection.close()
        self._give_slots(slots)


async def _acquire(own: asyncio.Semaphore | None, shared: asyncio.Semaphore | None) -> None:
    if own is not None:
        await own.acquire()
    if shared is not None:
        try:
            await shared.acquire()
        except BaseException:
            if own is not None:
                own.release()
            raise
