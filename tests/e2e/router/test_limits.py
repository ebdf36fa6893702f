"""The router's limits (issue 14): read timeouts, the in-flight limit, bounded upstream
connections; and its API's access rules: the API key, /debug/* opt-in and free of side effects,
the x-kvroute-* headers switch. A real router, real Redis, real HTTP (workers from fake_worker)."""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
import pytest
from multidict import CIMultiDict

from router.main import RunningRouter
from router.routing.scoring import Policy
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

# A request's head announcing a 100-byte body (the tests send less).
HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"


def _port(router: RunningRouter) -> int:
    return int(router.url.rsplit(":", 1)[1])


async def test_a_half_sent_body_gets_408_and_its_connection_closed_while_others_are_served(redis_server, index, caplog):
    worker = FakeWorker("w1")
    async with workers_and_router(redis_server, index, [worker], body_timeout_s=0.5, header_timeout_s=0.5) as router:
        slow = asyncio.create_task(raw_request(_port(router), HEAD + b'{"model": "fake", "prompt"'))
        half_headers = asyncio.create_task(raw_request(_port(router), b"POST /v1/completions HTTP/1.1\r\nHost: r"))
        assert (await post(router.url + "/v1/completions", BODY))[0] == 200  # served meanwhile
        reply = await slow  # returns only once the router closed the connection
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        assert b"did not arrive within 0.5 s" in reply
        assert await half_headers == b""  # closed without a reply: its headers never ended
        assert (await post(router.url + "/v1/completions", BODY))[0] == 200
    # The timer's refusal raised nothing into the event loop (which would skip other timers).
    assert not [r for r in caplog.records if r.name == "asyncio" and r.levelno >= logging.ERROR]


async def test_an_idle_keep_alive_connection_is_closed_at_the_header_timeout_after_its_requests(redis_server, index):
    worker = FakeWorker("w1")
    async with workers_and_router(redis_server, index, [worker], header_timeout_s=0.5) as router:
        body = json.dumps(BODY).encode()
        request = HEAD.replace(b"100", str(len(body)).encode()) + body
        reader, writer = await asyncio.open_connection("127.0.0.1", _port(router))
        try:
            for _ in range(2):  # the timer is re-armed after each reply, not left from the first
                writer.write(request)
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
                assert head.startswith(b"HTTP/1.1 200"), head[:200]
                length = int(reply_headers(head)[1]["Content-Length"])
                await asyncio.wait_for(reader.readexactly(length), 10)
            assert await asyncio.wait_for(reader.read(), 10) == b""  # closed by the router, idle
        finally:
            writer.close()


async def test_past_the_inflight_limit_429_with_retry_after_then_served_again(redis_server, index):
    worker = FakeWorker("w1")
    async with workers_and_router(redis_server, index, [worker], max_inflight=1) as router:
        holder = asyncio.create_task(raw_request(_port(router), HEAD + b'{"model"'))  # holds the one slot

        async def held() -> bool:
            return await metric(router.url, "kvroute_router_admitted_requests") == 1

        await wait_until(held, 10)
        refused: list[tuple[int, CIMultiDict[str], dict]] = []

        async def limited() -> bool:
            refused[:] = [await post(router.url + "/v1/completions", BODY)]
            return refused[0][0] == 429

        await wait_until(limited, 10)
        _, headers, body = refused[0]
        assert headers["Retry-After"] == "1" and body["error"]["type"] == "rate_limit_error"
        assert "limit of 1 requests in flight" in body["error"]["message"]
        assert (await post(router.url + "/debug/route", BODY))[0] == 429  # /debug/ counts too
        async with aiohttp.ClientSession() as session, session.get(router.url + "/health") as response:
            assert response.status == 200  # probes are not limited
        holder.cancel()  # the client goes away: its slot is freed

        async def served() -> bool:
            return (await post(router.url + "/v1/completions", BODY))[0] == 200

        await wait_until(served, 10)


async def test_connections_to_one_worker_are_bounded_and_the_rest_wait(redis_server, index):
    worker = FakeWorker("w1", mode="hold")
    async with workers_and_router(redis_server, index, [worker], upstream_connections_per_worker=2) as router:
        sent = [asyncio.create_task(post(router.url + "/v1/completions", BODY)) for _ in range(5)]

        async def two_busy_three_waiting() -> bool:
            queued = await metric(router.url, "kvroute_router_upstream_queued")
            return worker.active == 2 and queued == 3

        await wait_until(two_busy_three_waiting, 10)
        worker.release()
        replies = await asyncio.gather(*sent)
        assert [status for status, _, _ in replies] == [200] * 5
        assert worker.most_active == 2 and await metric(router.url, "kvroute_router_upstream_queued") == 0


async def test_debug_route_is_opt_in_and_behind_the_key(redis_server, index):
    async with workers_and_router(redis_server, index, [FakeWorker("w1")], enable_debug=False) as router:
        status, _, body = await post(router.url + "/debug/route", BODY)
        assert status == 404 and body["error"]["type"] == "not_found_error"
        assert await _get_status(router.url + "/debug/model") == 404
    keyed = {"enable_debug": True, "api_keys": frozenset({"k1"})}
    async with workers_and_router(redis_server, index, [FakeWorker("w2")], **keyed) as router:
        assert (await post(router.url + "/debug/route", BODY))[0] == 401
        status, _, body = await post(router.url + "/debug/route", BODY, {"Authorization": "Bearer k1"})
        assert status == 200 and body["chosen"] in ("w1", "w2")
        assert await _get_status(router.url + "/debug/model") == 401
        assert await _get_status(router.url + "/debug/model", {"Authorization": "Bearer k1"}) == 200


async def _get_status(url: str, headers: dict[str, str] | None = None) -> int:
    async with aiohttp.ClientSession() as session, session.get(url, headers=headers) as response:
        return response.status


async def test_debug_route_changes_no_routing_state(redis_server, index):
    workers = [FakeWorker(f"w{n}") for n in range(3)]
    async with workers_and_router(redis_server, index, workers, policy=Policy.ROUND_ROBIN) as router:

        async def three_workers() -> bool:
            return len(router.state.fleet.alive(MODEL)) == 3

        await wait_until(three_workers, 10)
        url = router.url
        first = (await post(url + "/v1/completions", BODY))[1]["x-kvroute-worker"]
        explained = [(await post(url + "/debug/route", BODY))[2]["chosen"] for _ in range(4)]
        requests_before = await metric(url, "kvroute_router_decision_seconds_count")
        then = (await post(url + "/v1/completions", BODY))[1]["x-kvroute-worker"]
        # Round robin's next turn, not used up by the four explanations: each named it.
        assert explained == [then] * 4 and then == f"w{(int(first[1]) + 1) % 3}", (first, explained, then)
        assert await metric(url, "kvroute_router_decision_seconds_count") == requests_before + 1


@pytest.mark.parametrize(
    ("settings", "exposed"),
    [
        ({}, True),  # no API key: as before
        ({"expose_routing_headers": False}, False),
        ({"api_keys": frozenset({"k1"})}, False),  # tenants: hidden by default
        ({"api_keys": frozenset({"k1"}), "expose_routing_headers": True}, True),
    ],
)
async def test_routing_headers_switch(redis_server, index, settings, exposed):
    async with workers_and_router(redis_server, index, [FakeWorker("w1")], **settings) as router:
        status, headers, body = await post(router.url + "/v1/completions", BODY, {"Authorization": "Bearer k1"})
        assert status == 200 and body == REPLY
        assert ("x-kvroute-worker" in headers, "x-kvroute-cached-tokens" in headers) == (exposed, exposed)
        assert len(headers.getall("x-request-id")) == 1  # the router's, not also the worker's


async def test_bearer_is_case_insensitive_and_no_key_is_warned_once(redis_server, index, caplog):
    caplog.set_level(logging.WARNING, logger="router")
    async with workers_and_router(redis_server, index, [FakeWorker("w1")], api_keys=frozenset({"k1"})) as router:
        url = router.url + "/v1/completions"
        for scheme in ("Bearer", "bearer", "BEARER"):
            assert (await post(url, BODY, {"Authorization": f"{scheme} k1"}))[0] == 200, scheme
        for auth in ("Basic k1", "Bearer k2", "Bearer", "k1"):
            assert (await post(url, BODY, {"Authorization": auth}))[0] == 401, auth
    assert not [r for r in caplog.records if "authentication is OFF" in r.getMessage()]
    async with workers_and_router(redis_server, index, [FakeWorker("w2")]):
        pass
    warned = [r for r in caplog.records if "authentication is OFF" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
