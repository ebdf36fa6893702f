"""The router's client to the workers (router.upstream.pool, router.upstream.http1) against real servers on real
sockets: an aiohttp server where a well-behaved worker is enough, raw asyncio servers where the
test needs bytes no server library would send (no length, a 100 Continue, garbage, an early close)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
from aiohttp import web

from router.upstream import pool as upstream_module
from router.upstream.http1 import UpstreamBroken
from router.upstream.pool import UpstreamPool, _head, _target
from tests.support import wait_until

Raw = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def raw_server(handle: Raw) -> AsyncIterator[str]:
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One request off the connection: its head and body."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")
    )
    return head, await reader.readexactly(length)


class Worker:
    """An aiohttp worker that echoes the body, counts connections, and streams on /stream."""

    def __init__(self) -> None:
        self.connections: set[object] = set()
        self.heads: list[dict[str, str]] = []
        self.release = asyncio.Event()
        self.release.set()

    async def echo(self, request: web.Request) -> web.Response:
        self.connections.add(request.transport)
        self.heads.append(dict(request.headers))
        body = await request.read()
        await self.release.wait()
        return web.Response(body=body, content_type="application/json")

    async def stream(self, request: web.Request) -> web.StreamResponse:
        self.connections.add(request.transport)
        pieces = int((await request.read()).decode())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(pieces):
            await response.write(f"data: {i:06d}{'x' * 4000}\n\n".encode())
        await response.write_eof()
        return response


@asynccontextmanager
async def aiohttp_worker() -> AsyncIterator[tuple[str, Worker]]:
    worker = Worker()
    app = web.Application()
    app.router.add_post("/v1/completions", worker.echo)
    app.router.add_post("/stream", worker.stream)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", worker
    finally:
        await runner.cleanup()


def new_pool(limit: int = 0, per_worker: int = 0, read_timeout_s: float = 10.0) -> UpstreamPool:
    return UpstreamPool(limit, per_worker, connect_timeout_s=2.0, read_timeout_s=read_timeout_s)


async def test_a_reply_read_to_its_end_leaves_its_connection_for_the_next_request():
    async with aiohttp_worker() as (url, worker):
        pool = new_pool()
        for i in range(3):
            reply = await pool.post(url + "/v1/completions", b'{"n": %d}' % i, [("Content-Type", "application/json")])
            assert reply.status == 200 and reply.content_length == len(b'{"n": 0}')
            assert await reply.read() == b'{"n": %d}' % i
            reply.close()
        await pool.close()
    assert len(worker.connections) == 1
    assert worker.heads[0]["Content-Type"] == "application/json" and worker.heads[0]["Host"] == url[len("http://") :]


async def test_a_stream_comes_in_pieces_and_a_reply_given_up_midway_closes_its_connection():
    async with aiohttp_worker() as (url, worker):
        pool = new_pool()
        reply = await pool.post(url + "/stream", b"400", [])  # ~1.6 MB: past the pause mark
        assert reply.headers["Content-Type"] == "text/event-stream" and reply.content_length is None
        transport = reply._connection.transport

        async def paused() -> bool:  # nobody reads yet: past HIGH_WATER the worker's socket pauses
            return not transport.is_reading()

        await wait_until(paused, 10, interval=0.01)
        received = [chunk async for chunk in reply.iter_any()]  # and resumes as the reader catches up
        reply.close()
        text = b"".join(received).decode()
        assert [int(event[6:12]) for event in text.split("\n\n") if event] == list(range(400))
        reply = await pool.post(url + "/stream", b"400", [])  # the same connection, kept
        async for _ in reply.iter_any():
            break
        reply.close()  # not read to its end: closed, not kept
        reply = await pool.post(url + "/stream", b"1", [])
        assert (await reply.read()).startswith(b"data: 000000")
        reply.close()
        await pool.close()
    assert len(worker.connections) == 2


async def test_the_limits_queue_requests_and_count_them():
    async with aiohttp_worker() as (url, worker):
        pool = new_pool(limit=4, per_worker=1)
        worker.release.clear()
        first = asyncio.create_task(pool.post(url + "/v1/completions", b"1", []))
        second = asyncio.create_task(pool.post(url + "/v1/completions", b"2", []))

        async def one_queued() -> bool:
            return pool.queued == 1

        await wait_until(one_queued, 10, interval=0.01)
        worker.release.set()
        reply = await first
        assert await reply.read() == b"1"
        assert not second.done()  # its slot is held until the first reply is closed
        reply.close()
        reply = await second
        assert await reply.read() == b"2" and pool.queued == 0
        reply.close()
        await pool.close()


async def test_an_idle_connection_is_not_kept_past_the_keep_alive(monkeypatch):
    monkeypatch.setattr(upstream_module, "IDLE_KEEP_S", 0.0)
    async with aiohttp_worker() as (url, worker):
        pool = new_pool()
        for _ in range(2):
            reply = await pool.post(url + "/v1/completions", b"{}", [])
            await reply.read()
            reply.close()
        await pool.close()
    assert len(worker.connections) == 2


async def test_a_body_without_a_length_ends_with_the_connection():
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # skipped: the real reply follows
        writer.write(b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n{"a":')
        await writer.drain()
        writer.write(b" 1}")
        writer.close()

    async with raw_server(handle) as url:
        pool = new_pool()
        reply = await pool.post(url + "/v1/completions", b"{}", [])
        assert reply.status == 200 and await reply.read() == b'{"a": 1}'
        reply.close()
        await pool.close()


@pytest.mark.parametrize(
    "answer",
    [b"", b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort", b"SMTP ready\r\n\r\n"],
    ids=["nothing", "cut-short", "not-http"],
)
async def test_a_worker_that_breaks_the_exchange_raises_a_connection_error(answer):
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(answer)
        writer.close()

    async with raw_server(handle) as url:
        pool = new_pool()
        with pytest.raises(UpstreamBroken):
            reply = await pool.post(url + "/v1/completions", b"{}", [])
            await reply.read()
        await pool.close()


async def test_a_worker_that_never_answers_times_out_and_a_closed_port_refuses():
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(30)

    async with raw_server(handle) as url:
        pool = new_pool(read_timeout_s=0.2)
        with pytest.raises(TimeoutError):
            await pool.post(url + "/v1/completions", b"{}", [])
        await pool.close()
    with pytest.raises(ConnectionRefusedError):
        await new_pool().post(url + "/v1/completions", b"{}", [])


async def test_a_kept_connection_the_worker_closes_unanswered_is_replaced_once():
    connections = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await read_request(reader)  # the second request on a connection: closed, unanswered
        writer.close()

    async with raw_server(handle) as url:
        pool = new_pool()
        for _ in range(3):
            reply = await pool.post(url + "/v1/completions", b"{}", [])
            assert await reply.read() == b"ok"
            reply.close()
        await pool.close()
    assert len(connections) == 3  # the second and third requests each came again on a new one


def test_a_header_that_would_split_the_request_is_not_sent():
    head = _head(_target("http://w:8000/v1/completions?x=1"), [("A", "1"), ("B", "2\r\nEvil: yes")], 7)
    assert head == b"POST /v1/completions?x=1 HTTP/1.1\r\nHost: w:8000\r\nA: 1\r\nContent-Length: 7\r\n\r\n"
