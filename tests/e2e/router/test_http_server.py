"""The router's HTTP server (router.http.server) on a real router, over raw TCP: every endpoint on
one connection, in order; the framings HTTP/1.1 allows (chunked, 100-continue, HTTP/1.0, HEAD,
pipelining); what request smuggling relies on refused with a 400 and the router serving on;
oversized and slow heads and bodies refused before they are read; and a fuzz run of mutated
requests, which never gets a 5xx or stops the router."""

from __future__ import annotations

import asyncio
import json
import socket

import httptools
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict

from router.main import RunningRouter
from tests.support.fake_worker import MODEL, REPLY, FakeWorker, metric, post, workers_and_router

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


async def test_every_endpoint_is_served_on_one_connection_in_order(redis_server, index):
    async with workers_and_router(redis_server, index, [FakeWorker("w1")]) as router:
        get = b"GET %s HTTP/1.1\r\nHost: r\r\n\r\n"
        # One completion alone; then a probe, a scrape, an unknown path, a completion's wrong
        # method and a completion, pipelined in one write: answered in order.
        pipelined = get % b"/health" + get % b"/metrics" + get % b"/nowhere" + get % b"/v1/completions"
        replies = await exchange(_port(router), completion("a-1"), pipelined + completion("a-2"), replies=6)
        assert [status for status, _, _ in replies] == [200, 200, 200, 404, 405, 200]
        assert json.loads(replies[0][2]) == REPLY and replies[0][1]["X-Request-Id"] == "a-1"
        assert json.loads(replies[1][2])["status"] == "ok"
        assert b"kvroute_router_requests_total" in replies[2][2]
        assert json.loads(replies[3][2])["error"]["type"] == "not_found_error"  # OpenAI's shape
        assert replies[4][1]["Allow"] == "POST"
        assert json.loads(replies[5][2]) == REPLY and replies[5][1]["X-Request-Id"] == "a-2"


async def test_a_head_request_gets_the_get_reply_without_its_body_and_the_connection_goes_on(redis_server, index):
    async with workers_and_router(redis_server, index, [FakeWorker("w1")]) as router:
        head = b"HEAD /health HTTP/1.1\r\nHost: r\r\n\r\n"
        reader, writer = await asyncio.open_connection("127.0.0.1", _port(router))
        try:
            writer.write(head + completion("after"))
            raw = b""  # read as bytes: a HEAD reply announces a length it does not carry
            while raw.count(b"HTTP/1.1 200") < 2 or not raw.endswith(json.dumps(REPLY).encode()):
                chunk = await asyncio.wait_for(reader.read(65536), 20)
                assert chunk, raw
                raw += chunk
        finally:
            writer.close()
        first, _, rest = raw.partition(b"\r\n\r\n")
        assert first.startswith(b"HTTP/1.1 200") and b"content-length: " in first.lower()
        assert rest.startswith(b"HTTP/1.1 200")  # no body between the two replies
        assert b"x-request-id: after" in rest.lower()


async def test_pipelined_completions_are_answered_in_order(redis_server, index):
    async with workers_and_router(redis_server, index, [FakeWorker("w1")]) as router:
        pipelined = b"".join(completion(f"p-{i}") for i in range(5))
        replies = await exchange(_port(router), pipelined, replies=5)
        assert [headers["X-Request-Id"] for _, headers, _ in replies] == [f"p-{i}" for i in range(5)]
        assert all(status == 200 and json.loads(body) == REPLY for status, _, body in replies)
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
async def test_every_framing_http_1_1_allows_is_served(redis_server, index, request_bytes):
    worker = FakeWorker("w1")
    async with workers_and_router(redis_server, index, [worker]) as router:
        replies = await exchange(_port(router), request_bytes, replies=1)
        assert len(replies) == 1 and replies[0][0] == 200, replies
        assert json.loads(replies[0][2]) == REPLY
        assert len(worker.received) == 1


SMUGGLING = {  # heads (after the request line and Host) and bodies llhttp refuses
    "length-and-chunked": b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\nxxxxx",
    "two-lengths": b"Content-Length: 5\r\nContent-Length: 6\r\n\r\nxxxxx",
    "space-before-colon": b"Content-Length : 5\r\n\r\nxxxxx",
    "negative-length": b"Content-Length: -5\r\n\r\nxxxxx",
    "plus-length": b"Content-Length: +5\r\n\r\nxxxxx",
    "obs-fold": b"X-A: b\r\n c\r\nContent-Length: 5\r\n\r\nxxxxx",
    "chunked-then-identity": b"Transfer-Encoding: chunked, identity\r\n\r\n5\r\nxxxxx\r\n0\r\n\r\n",
    "unknown-coding": b"Transfer-Encoding: xchunked\r\n\r\n5\r\nxxxxx\r\n0\r\n\r\n",
    "two-codings": b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "coding-space-colon": b"Transfer-Encoding : chunked\r\n\r\n0\r\n\r\n",
    "bad-chunk-size": b"Transfer-Encoding: chunked\r\n\r\nzz\r\nxxxxx\r\n0\r\n\r\n",
    "nul-in-value": b"X-A: a\x00b\r\nContent-Length: 5\r\n\r\nxxxxx",
    "space-in-name": b"X A: b\r\nContent-Length: 5\r\n\r\nxxxxx",
}


@pytest.mark.parametrize("head", [pytest.param(head, id=name) for name, head in SMUGGLING.items()])
async def test_smuggling_heads_get_400_and_the_router_keeps_serving(redis_server, index, head, caplog):
    worker = FakeWorker("w1")
    async with workers_and_router(redis_server, index, [worker]) as router:
        bad = b"POST /v1/completions HTTP/1.1\r\nHost: r\r\n" + head + completion("smuggled")
        replies = await exchange(_port(router), bad, replies=2)  # the router closes after one
        assert len(replies) == 1 and replies[0][0] == 400, replies
        assert json.loads(replies[0][2])["error"]["message"].startswith("malformed HTTP request: ")
        assert worker.received == []  # not the request, not the one smuggled behind it
        assert (await post(router.url + "/v1/completions", json.loads(BODY)))[0] == 200
    assert not [r for r in caplog.records if r.exc_info]  # one line, no traceback


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        pytest.param(b"G@T /health HTTP/1.1\r\nHost: r\r\n\r\n", 400, id="bad-method"),
        pytest.param(b"GET /health HTTP/1.1\nHost: r\n\n", 400, id="bare-line-feeds"),
        pytest.param(b"GET /health HTTP/2.0\r\nHost: r\r\n\r\n", 505, id="http-2-text"),
        pytest.param(b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: r\r\n\r\n", 414, id="long-target"),
        pytest.param(b"GET /health HTTP/1.1\r\n" + b"X-Pad: " + b"p" * 70_000 + b"\r\n\r\n", 431, id="long-head"),
        pytest.param(
            b"GET /health HTTP/1.1\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(7000)) + b"\r\n",
            431,
            id="many-headers",
        ),
    ],
)
async def test_malformed_and_oversized_heads_get_one_clear_error(redis_server, index, request_bytes, status):
    async with workers_and_router(redis_server, index, [FakeWorker("w1")]) as router:
        replies = await exchange(_port(router), request_bytes, replies=2)
        assert len(replies) == 1 and replies[0][0] == status, replies
        assert set(json.loads(replies[0][2])["error"]) == {"message", "type", "param", "code"}
        assert (await post(router.url + "/v1/completions", json.loads(BODY)))[0] == 200


async def test_a_chunked_body_past_the_limit_is_413_as_it_grows(redis_server, index):
    worker = FakeWorker("w1")
    async with workers_and_router(redis_server, index, [worker], max_body_bytes=1024) as router:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n\r\n"
        chunk = b"400\r\n" + b"x" * 1024 + b"\r\n"
        replies = await exchange(_port(router), head + chunk * 3, replies=2)
        assert len(replies) == 1 and replies[0][0] == 413 and replies[0][1]["Connection"] == "close"
        assert worker.received == []
        assert await metric(router.url, "kvroute_router_admitted_requests") == 0


async def test_a_head_sent_too_slowly_is_cut_off_at_the_header_timeout(redis_server, index):
    async with workers_and_router(redis_server, index, [FakeWorker("w1")], header_timeout_s=0.5) as router:
        reader, writer = await asyncio.open_connection("127.0.0.1", _port(router))
        try:
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\n")  # and no more (slowloris)
            assert await asyncio.wait_for(reader.read(), 10) == b""  # closed by the router, unanswered
        finally:
            writer.close()
        assert (await post(router.url + "/v1/completions", json.loads(BODY)))[0] == 200


async def test_an_upgrade_is_served_as_a_plain_request_then_the_connection_closes(redis_server, index):
    async with workers_and_router(redis_server, index, [FakeWorker("w1")]) as router:
        upgrade = b"GET /health HTTP/1.1\r\nHost: r\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"
        replies = await exchange(_port(router), upgrade + b"\x81\x05hello", replies=2)
        assert [status for status, _, _ in replies] == [200]
        assert replies[0][1]["Connection"] == "close"


async def test_a_body_past_the_limit_is_413_before_it_is_read(redis_server, index):
    worker = FakeWorker("w1")
    async with workers_and_router(redis_server, index, [worker], max_body_bytes=1024) as router:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 5000\r\n\r\n"
        replies = await exchange(_port(router), head + b"{", replies=2)  # the router closes after one
        assert len(replies) == 1 and replies[0][0] == 413
        assert replies[0][1]["Connection"] == "close"
        assert json.loads(replies[0][2])["error"]["message"] == "the request body exceeds 1024 bytes"
        assert worker.received == []
        assert await metric(router.url, "kvroute_router_admitted_requests") == 0


async def test_the_router_stops_promptly_with_idle_connections_open(redis_server, index):
    async with asyncio.timeout(30):  # a shutdown that waited on these connections would hang here
        async with workers_and_router(redis_server, index, [FakeWorker("w1")]) as router:
            idle = await asyncio.open_connection("127.0.0.1", _port(router))
            probed = await asyncio.open_connection("127.0.0.1", _port(router))
            idle[1].write(completion("kept"))
            probed[1].write(b"HEAD /health HTTP/1.1\r\nHost: r\r\n\r\n")
            assert (await idle[0].readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
            assert (await probed[0].readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        for reader, _ in (idle, probed):  # both were closed by the router as it stopped
            await asyncio.wait_for(reader.read(), 10)
            assert reader.at_eof()
        idle[1].close()
        probed[1].close()


SEEDS = [
    completion("fuzz"),
    b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n",
    CHUNKED,
    completion(extra=b"Expect: 100-continue\r\n"),
    b"GET /v1/models HTTP/1.0\r\nConnection: keep-alive\r\n\r\n",
]


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A valid request with a few bytes flipped, inserted, dropped or the end cut off, or two
    requests run together."""
    data = bytearray(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data)))
        kind = draw(st.sampled_from(["flip", "insert", "drop", "cut", "join"]))
        if kind == "flip" and at < len(data):
            data[at] = draw(st.integers(0, 255))
        elif kind == "insert":
            data[at:at] = draw(
                st.sampled_from([b"\r\n", b"\n", b" ", b":", b"\x00", b"0\r\n\r\n", b"Content-Length: 9\r\n"])
            )
        elif kind == "drop":
            del data[at : at + draw(st.integers(1, 8))]
        elif kind == "cut":
            del data[at:]
        elif kind == "join":
            data += draw(st.sampled_from(SEEDS))
    return bytes(data)


def fuzz(port: int, examples: int) -> list[str]:
    """Send ``examples`` mutated requests, each on its own connection (blocking sockets: run in a
    thread beside the router's loop); the statuses >= 500 seen, with what was sent."""
    failures: list[str] = []

    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(mutated())
    def one(data: bytes) -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)  # the request ends here: what is cut off stays cut off
            replies = _Replies()
            while chunk := sock.recv(65536):
                try:
                    replies.parser.feed_data(chunk)
                except httptools.HttpParserError as exc:
                    failures.append(f"{data!r}: a reply that is not HTTP ({exc})")
                    return
        failures.extend(f"{data!r}: {status}" for status, _, _ in replies.done if status >= 500 and status != 505)

    one()
    return failures


async def test_mutated_requests_never_get_a_server_error_nor_stop_the_router(redis_server, index, caplog):
    async with workers_and_router(redis_server, index, [FakeWorker("w1")], header_timeout_s=2.0) as router:
        failures = await asyncio.to_thread(fuzz, _port(router), 300)
        assert failures == []
        assert (await post(router.url + "/v1/completions", json.loads(BODY)))[0] == 200
        assert await metric(router.url, "kvroute_router_admitted_requests") == 0  # every slot given back
    assert not [r for r in caplog.records if r.exc_info and r.name.startswith("router")]  # none for a client's bytes
