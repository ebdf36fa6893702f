"""The lean HTTP/1.1 front (router.front) on a real router, over raw TCP: the completion endpoints
served by it, every other request handed to aiohttp's server on the same connection, in order;
heads it leaves to aiohttp (chunked, 100-continue, HTTP/1.0, smuggling attempts) answered as
before; a body past the limit refused before it is read."""

from __future__ import annotations

import asyncio
import json

import httptools
import pytest
from multidict import CIMultiDict

from router.main import RunningRouter
from tests.e2e.router.fake_worker import MODEL, REPLY, FakeWorker, metric, post, workers_and_router

BODY = json.dumps({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1}).encode()


def _port(router: RunningRouter) -> int:
    return int(router.url.rsplit(":", 1)[1])


def completion(request_id: str = "", extra: bytes = b"", body: bytes = BODY, version: bytes = b"1.1") -> bytes:
    head = b"POST /v1/completions HTTP/" + version + b"\r\nHost: r\r\nContent-Type: application/json\r\n"
    if request_id:
        head += b"X-Request-Id: " + request_id.encode() + b"\r\n"
    return head + extra + b"Content-Length: %d\r\n\r\n" % len(body) + body


class _Replies:
    """httptools' callbacks: each whole reply (1xx ones skipped) as (status, headers, body)."""

    def __init__(self) -> None:
        self.done: list[tuple[int, CIMultiDict[str], bytes]] = []
        self._headers: CIMultiDict[str] = CIMultiDict()
        self._body = bytearray()
        self.parser = httptools.HttpResponseParser(self)

    def on_message_begin(self) -> None:
        self._headers, self._body = CIMultiDict(), bytearray()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.add(name.decode(), value.decode())

    def on_body(self, body: bytes) -> None:
        self._body += body

    def on_message_complete(self) -> None:
        status = self.parser.get_status_code()
        if status >= 200:
            self.done.append((status, self._headers, bytes(self._body)))


async def exchange(port: int, *writes: bytes, replies: int) -> list[tuple[int, CIMultiDict[str], bytes]]:
    """Send each of ``writes`` on one connection (waiting for a reply between them), and read
    until ``replies`` whole replies came back or the router closed the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    seen = _Replies()
    try:
        for i, data in enumerate(writes):
            writer.write(data)
            await writer.drain()
            wanted = replies if i == len(writes) - 1 else len(seen.done) + 1
            while len(seen.done) < wanted:
                chunk = await asyncio.wait_for(reader.read(65536), 20)
                if not chunk:
                    return seen.done
                seen.parser.feed_data(chunk)
    finally:
        writer.close()
    return seen.done


def handovers(router: RunningRouter) -> float:
    """Read in the process: a scrape over HTTP would be a handed-over connection of its own."""
    return router.state.metrics.registry.get_sample_value("kvroute_router_http_handovers_total") or 0.0


async def test_other_endpoints_are_passed_on_and_the_connection_stays_lean(redis_server, index):
    async with workers_and_router(redis_server, index, [FakeWorker("w1")]) as router:
        get = b"GET %s HTTP/1.1\r\nHost: r\r\n\r\n"
        # One completion alone; then a probe, a scrape, an unknown path, a completion's wrong
        # method and a completion, pipelined in one write: answered in order, by the right server.
        pipelined = get % b"/health" + get % b"/metrics" + get % b"/nowhere" + get % b"/v1/completions"
        replies = await exchange(_port(router), completion("a-1"), pipelined + completion("a-2"), replies=6)
        assert [status for status, _, _ in replies] == [200, 200, 200, 404, 405, 200]
        assert json.loads(replies[0][2]) == REPLY and replies[0][1]["X-Request-Id"] == "a-1"
        assert json.loads(replies[1][2])["status"] == "ok"
        assert b"kvroute_router_requests_total" in replies[2][2]
        assert json.loads(replies[3][2])["error"]["type"] == "not_found_error"  # aiohttp's middleware's shape
        assert replies[4][1]["Allow"] == "POST"
        assert json.loads(replies[5][2]) == REPLY and replies[5][1]["X-Request-Id"] == "a-2"
        assert handovers(router) == 0


async def test_a_request_the_lean_front_cannot_take_hands_the_connection_to_aiohttp(redis_server, index):
    async with workers_and_router(redis_server, index, [FakeWorker("w1")]) as router:
        head = b"HEAD /health HTTP/1.1\r\nHost: r\r\n\r\n"
        reader, writer = await asyncio.open_connection("127.0.0.1", _port(router))
        try:
            writer.write(head + completion("after"))
            raw = b""  # read as bytes: a HEAD reply announces a length it does not carry
            while raw.count(b"HTTP/1.1 200") < 2:
                chunk = await asyncio.wait_for(reader.read(65536), 20)
                assert chunk, raw
                raw += chunk
        finally:
            writer.close()
        assert raw.startswith(b"HTTP/1.1 200")
        assert b"x-request-id: after" in raw.lower() and raw.endswith(json.dumps(REPLY).encode())
        assert handovers(router) == 1  # at the HEAD; aiohttp served the rest of the connection


async def test_pipelined_completions_stay_on_the_lean_front_in_order(redis_server, index):
    async with workers_and_router(redis_server, index, [FakeWorker("w1")]) as router:
        pipelined = b"".join(completion(f"p-{i}") for i in range(5))
        replies = await exchange(_port(router), pipelined, replies=5)
        assert [headers["X-Request-Id"] for _, headers, _ in replies] == [f"p-{i}" for i in range(5)]
        assert all(status == 200 and json.loads(body) == REPLY for status, _, body in replies)
        assert handovers(router) == 0
        assert await metric(router.url, "kvroute_router_admitted_requests") == 0  # every slot given back


CHUNKED = (
    b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n" % len(BODY) + BODY + b"\r\n0\r\n\r\n"
)


@pytest.mark.parametrize(
    "request_bytes",
    [
        pytest.param(CHUNKED, id="chunked"),
        pytest.param(completion(extra=b"Expect: 100-continue\r\n"), id="100-continue"),
        pytest.param(completion(version=b"1.0"), id="http-1.0"),
        pytest.param(completion().replace(b"POST /v1/completions ", b"POST /v1/completions?x=1 "), id="query"),
    ],
)
async def test_requests_the_lean_front_leaves_to_aiohttp_are_served(redis_server, index, request_bytes):
    async with workers_and_router(redis_server, index, [FakeWorker("w1")]) as router:
        replies = await exchange(_port(router), request_bytes, replies=1)
        assert len(replies) == 1 and replies[0][0] == 200, replies
        assert json.loads(replies[0][2]) == REPLY
        assert handovers(router) == 1


@pytest.mark.parametrize(
    "head",
    [
        pytest.param(b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n", id="length-and-chunked"),
        pytest.param(b"Content-Length: 5\r\nContent-Length: 6\r\n", id="two-lengths"),
        pytest.param(b"Content-Length : 5\r\n", id="space-before-colon"),
        pytest.param(b"Content-Length: -5\r\n", id="negative-length"),
    ],
)
async def test_smuggling_heads_get_400_and_the_router_keeps_serving(redis_server, index, head):
    async with workers_and_router(redis_server, index, [FakeWorker("w1")]) as router:
        bad = b"POST /v1/completions HTTP/1.1\r\nHost: r\r\n" + head + b"\r\n" + b"x" * 5
        replies = await exchange(_port(router), bad, replies=1)
        assert replies and replies[0][0] == 400, replies
        assert (await post(router.url + "/v1/completions", json.loads(BODY)))[0] == 200


async def test_a_body_past_the_limit_is_413_before_it_is_read(redis_server, index):
    worker = FakeWorker("w1")
    async with workers_and_router(redis_server, index, [worker], max_body_bytes=1024) as router:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 5000\r\n\r\n"
        replies = await exchange(_port(router), head + b"{", replies=2)  # the router closes after one
        assert len(replies) == 1 and replies[0][0] == 413
        assert replies[0][1]["Connection"] == "close"
        assert json.loads(replies[0][2])["error"]["message"] == "the request body exceeds 1024 bytes"
        assert worker.received == [] and handovers(router) == 0
        assert await metric(router.url, "kvroute_router_admitted_requests") == 0


async def test_the_router_stops_promptly_with_idle_and_handed_over_connections_open(redis_server, index):
    async with asyncio.timeout(30):  # a shutdown that waited on these connections would hang here
        async with workers_and_router(redis_server, index, [FakeWorker("w1")]) as router:
            idle = await asyncio.open_connection("127.0.0.1", _port(router))
            handed = await asyncio.open_connection("127.0.0.1", _port(router))
            idle[1].write(completion("kept"))
            handed[1].write(b"HEAD /health HTTP/1.1\r\nHost: r\r\n\r\n")
            assert (await idle[0].readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
            assert (await handed[0].readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
            assert handovers(router) == 1
        for reader, _ in (idle, handed):  # both were closed by the router as it stopped
            await asyncio.wait_for(reader.read(), 10)
            assert reader.at_eof()
        idle[1].close()
        handed[1].close()
