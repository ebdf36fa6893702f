"""What the proxy passes and keeps (issue 14): RFC 9110 hop-by-hop headers (those Connection
names too) stay on their hop both ways, X-Request-Id is checked and sent once, Content-Encoding
goes with its body, redirects are not followed, client errors name no address, a 5xx does not
evict a worker while a refused connection does, and --worker-allow keeps foreign URLs out. The
proxy's rules are tested with both upstream clients (--upstream-client builtin and aiohttp)."""

from __future__ import annotations

import logging
import re

import aiohttp
import pytest

from kvindex.types import WorkerInfo
from kvroute.devstack.embedded_redis import free_port
from router.routing.scoring import Policy
from router.settings import UpstreamClientKind
from tests.support import wait_until
from tests.support.fake_worker import (
    BODY,
    MODEL,
    REPLY,
    FakeWorker,
    metric,
    post,
    raw_request,
    reply_headers,
    workers_and_router,
)

CLIENTS = pytest.mark.parametrize("client", list(UpstreamClientKind), ids=[k.value for k in UpstreamClientKind])


def _raw_completion(headers: str) -> bytes:
    body = b'{"model": "fake", "prompt": [1, 2, 3], "max_tokens": 1}'
    head = f"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n{headers}"
    return head.encode() + f"\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body


@CLIENTS
async def test_hop_by_hop_headers_stay_on_their_hop_and_the_request_id_goes_once(redis_server, index, client):
    worker = FakeWorker("w1")
    async with workers_and_router(redis_server, index, [worker], upstream_client=client) as router:
        port = int(router.url.rsplit(":", 1)[1])
        sent = (
            "Connection: close, X-Client-Hop\r\nX-Client-Hop: 1\r\nKeep-Alive: 5\r\nX-Request-Id: req-1.a\r\nX-Kept: y"
        )
        status, headers = reply_headers(await raw_request(port, _raw_completion(sent)))
        assert status == 200
        seen = worker.received[-1]
        assert "X-Client-Hop" not in seen and "Keep-Alive" not in seen and seen["X-Kept"] == "y"
        assert seen.getall("X-Request-Id") == ["req-1.a"]
        assert "Accept-Encoding" not in seen  # no client's header added: a worker must not compress unasked
        # The worker's reply named X-Worker-Secret in its Connection header: not relayed.
        assert "X-Worker-Secret" not in headers and headers.getall("X-Request-Id") == ["req-1.a"]
        async with aiohttp.ClientSession() as session, session.post(worker.url + "/v1/completions") as direct:
            assert direct.headers["X-Worker-Secret"] == "internal"  # the worker does send it


@CLIENTS
async def test_a_malformed_request_id_is_replaced_by_a_fresh_one(redis_server, index, client):
    worker = FakeWorker("w1")
    async with workers_and_router(redis_server, index, [worker], upstream_client=client) as router:
        for bad in ("x" * 129, "two words", "a\u00e9b"):
            status, headers, _ = await post(router.url + "/v1/completions", BODY, {"X-Request-Id": bad})
            given = headers["X-Request-Id"]
            assert status == 200 and re.fullmatch("[0-9a-f]{32}", given), given
            assert worker.received[-1].getall("X-Request-Id") == [given]


@CLIENTS
async def test_a_compressed_reply_keeps_its_content_encoding(redis_server, index, client):
    async with workers_and_router(
        redis_server, index, [FakeWorker("w1", mode="gzip")], upstream_client=client
    ) as router:
        status, headers, body = await post(router.url + "/v1/completions", BODY)  # aiohttp decompresses
        assert status == 200 and headers["Content-Encoding"] == "gzip" and body == REPLY


@CLIENTS
async def test_a_redirect_is_not_followed_and_errors_name_no_address(redis_server, index, client):
    target = FakeWorker("elsewhere")  # started, never registered: the redirect's target
    await target.start_unregistered()
    try:
        worker = FakeWorker("w1", mode="redirect", location=target.url + "/v1/completions")
        async with workers_and_router(redis_server, index, [worker], upstream_client=client) as router:
            status, headers, body = await post(router.url + "/v1/completions", BODY)
            assert status == 502 and "Location" not in headers and target.received == []
            assert "redirect" in body["error"]["message"] and "127.0.0.1" not in body["error"]["message"]
            dead = WorkerInfo("gone", "dead", f"http://127.0.0.1:{free_port()}", 16)
            await index.register(dead, ttl_ms=600_000)

            async def listed() -> bool:
                await router.state.fleet.refresh()
                return bool(router.state.fleet.alive("dead"))

            await wait_until(listed, 10)
            status, _, body = await post(router.url + "/v1/completions", {**BODY, "model": "dead"})
            message = body["error"]["message"]
            assert status == 502 and "connection failed" in message and "127.0.0.1" not in message, message
            assert not router.state.fleet.alive("dead")  # unreachable: not offered until listed again
    finally:
        await target.stop()


@CLIENTS
async def test_a_5xx_does_not_evict_its_worker(redis_server, index, client):
    failing, healthy = FakeWorker("w0", mode="error"), FakeWorker("w1")
    settings = {
        "policy": Policy.ROUND_ROBIN,
        "workers_refresh_s": 3600.0,
        "upstream_client": client,
    }  # no refresh re-adds a worker
    async with workers_and_router(redis_server, index, [failing, healthy], **settings) as router:
        await router.state.fleet.refresh()
        for _ in range(4):  # round robin: w0 is tried first twice, and the request retried on w1
            status, headers, _ = await post(router.url + "/v1/completions", BODY)
            assert status == 200 and headers["x-kvroute-worker"] == "w1"
        assert len(failing.received) == 2
        assert [w.worker_id for w in router.state.fleet.alive(MODEL)] == ["w0", "w1"]
        assert await metric(router.url, "kvroute_router_upstream_retries_total") == 2


async def test_workers_outside_the_allow_list_are_ignored_with_one_warning(redis_server, index, caplog):
    caplog.set_level(logging.WARNING, logger="router.allow")
    await index.register(WorkerInfo("intruder", MODEL, "http://attacker.example:80", 16), ttl_ms=600_000)
    allow = {"worker_allow": ("127.0.0.0/8",), "workers_refresh_s": 0.1}
    async with workers_and_router(redis_server, index, [FakeWorker("w1")], **allow) as router:
        fleet = router.state.fleet
        await wait_until(lambda: _refreshed_twice(fleet), 10)
        assert [w.worker_id for w in fleet.alive(MODEL)] == ["w1"]
        for _ in range(3):
            assert (await post(router.url + "/v1/completions", BODY))[0] == 200
    warned = [r.getMessage() for r in caplog.records if "intruder" in r.getMessage()]
    assert len(warned) == 1 and "outside --worker-allow" in warned[0], warned
    async with workers_and_router(redis_server, index, [], worker_allow=("10.0.0.0/8",)) as router:
        status, _, body = await post(router.url + "/v1/completions", BODY)
        assert status == 503 and "no alive worker" in body["error"]["message"]


_refreshes: dict[int, float] = {}


async def _refreshed_twice(fleet) -> bool:
    """True once the fleet refreshed again after the first call (its warnings came twice)."""
    first = _refreshes.setdefault(id(fleet), fleet.refreshed_at)
    return fleet.refreshed_at > first
