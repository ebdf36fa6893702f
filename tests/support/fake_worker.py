"""A worker that misbehaves on purpose, over real HTTP: registered in a real Redis under model
"fake", it answers /v1/completions as its ``mode`` says and keeps what it received."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from kvindex.redis_index import RedisIndex
from kvindex.types import WorkerInfo
from kvroute.devstack.embedded_redis import free_port
from kvservice.metrics_page import read_metrics
from router.main import RunningRouter
from tests.support.router import start_router

MODEL = "fake"
BODY = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1}  # a completion request
REPLY = {"id": "cmpl-1", "object": "text_completion", "choices": [{"text": "ok"}], "usage": {"prompt_tokens": 3}}


class FakeWorker:
    """Modes: ``json`` (a JSON reply, with a hop-by-hop header named in Connection and its own
    X-Request-Id), ``gzip`` (the same JSON, gzip-encoded), ``redirect`` (307 to ``location``),
    ``error`` (500), ``hold`` (waits for :meth:`release`, then ``json``)."""

    def __init__(self, worker_id: str, mode: str = "json", location: str = "") -> None:
        self.worker_id, self.mode, self.location = worker_id, mode, location
        self.port = free_port()
        self.received: list[CIMultiDict[str]] = []
        self.active = 0
        self.most_active = 0
        self._gate = asyncio.Event()
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, index: RedisIndex) -> FakeWorker:
        await self.start_unregistered()
        await index.register(WorkerInfo(self.worker_id, MODEL, self.url, 16), ttl_ms=600_000)
        return self

    async def start_unregistered(self) -> FakeWorker:
        app = web.Application()
        app.router.add_post("/v1/completions", self._complete)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    def release(self) -> None:
        self._gate.set()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _complete(self, request: web.Request) -> web.Response:
        self.received.append(CIMultiDict(request.headers))
        await request.read()
        self.active += 1
        self.most_active = max(self.most_active, self.active)
        try:
            if self.mode == "hold":
                await self._gate.wait()
            if self.mode == "redirect":
                return web.Response(status=307, headers={"Location": self.location})
            if self.mode == "error":
                return web.json_response({"error": "engine fell over"}, status=500)
            body = json.dumps(REPLY).encode()
            headers = {"Connection": "X-Worker-Secret", "X-Worker-Secret": "internal", "X-Request-Id": "worker-id"}
            if self.mode == "gzip":
                body = gzip.compress(body)
                headers["Content-Encoding"] = "gzip"
            return web.Response(body=body, content_type="application/json", headers=headers)
        finally:
            self.active -= 1


async def raw_request(port: int, data: bytes, within: float = 20) -> bytes:
    """Send ``data`` as is on a new TCP connection; everything the router sends until it closes
    the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), within)  # read(): until EOF
    finally:
        writer.close()


def reply_headers(raw: bytes) -> tuple[int, CIMultiDict[str]]:
    """The status and headers of a raw HTTP/1.1 reply."""
    head = raw.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    headers: CIMultiDict[str] = CIMultiDict()
    for line in head[1:]:
        name, _, value = line.partition(":")
        headers.add(name.strip(), value.strip())
    return int(head[0].split()[1]), headers


@contextlib.asynccontextmanager
async def workers_and_router(
    redis_server, index: RedisIndex, workers: list[FakeWorker], **settings
) -> AsyncIterator[RunningRouter]:
    for worker in workers:
        await worker.start(index)
    context, router = await start_router(redis_server.url, **settings)
    try:
        yield router
    finally:
        await context.__aexit__(None, None, None)  # type: ignore[attr-defined]
        for worker in workers:
            worker.release()
            await worker.stop()


async def post(url: str, body: dict, headers: dict[str, str] | None = None) -> tuple[int, CIMultiDict[str], dict]:
    async with aiohttp.ClientSession() as session, session.post(url, json=body, headers=headers) as response:
        return response.status, CIMultiDict(response.headers), await response.json(content_type=None)


async def metric(url: str, name: str) -> float | None:
    async with aiohttp.ClientSession() as session:
        return (await read_metrics(session, url + "/metrics")).value(name)
