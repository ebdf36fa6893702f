"""The router on aiohttp's low-level server (``--http-server aiohttp``, router.http.aiohttp_server):
the same routes, decisions and edge rules as the built-in server, over real HTTP to simulated
engines with agent processes: completions whole and streamed, routed to the worker that holds the
prompt; the edge rules' errors in OpenAI's shape; pipelined requests answered in order. And on
aiohttp's client to the workers (``--upstream-client aiohttp``): a stream relayed as it comes,
and a stream the client gives up closing its connection to the engine."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator

import aiohttp
import pytest

from kvroute.devstack.embedded_redis import free_port
from router.main import RunningRouter
from router.settings import HttpServerKind, UpstreamClientKind
from tests.e2e.router.test_http_server import _port, completion, exchange
from tests.support import ROOT, SimFleet, wait_for_workers, wait_until
from tests.support.router import start_router, wait_indexed

PROMPT = [(i * 13) % 1700 + 20 for i in range(96)]  # 6 blocks of 16
KEY = "sk-test-aiohttp"


@pytest.fixture
async def aiohttp_router(fleet: SimFleet, redis_server) -> AsyncIterator[RunningRouter]:
    context, running = await start_router(
        redis_server.url, http_server=HttpServerKind.AIOHTTP, max_body_bytes=4096, api_keys=frozenset({KEY})
    )
    await wait_for_workers(running, fleet.count)
    yield running
    await context.__aexit__(None, None, None)  # type: ignore[attr-defined]


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


async def test_whole_and_streamed_completions_are_routed_to_the_prompt_holder(aiohttp_router):
    url = aiohttp_router.url + "/v1/completions"
    body = {"model": "tiny", "prompt": [*PROMPT, 7], "max_tokens": 3}
    async with aiohttp.ClientSession(headers=_auth()) as session:
        async with session.post(url, json=body, headers={"X-Request-Id": "first-1"}) as response:
            assert response.status == 200, await response.text()
            first = await response.json()
            assert response.headers["X-Request-Id"] == "first-1"
            assert "aiohttp" in response.headers["Server"]  # aiohttp's server answered, not the built-in one
        holder = await wait_indexed(aiohttp_router, PROMPT)
        streamed = {**body, "prompt": [*PROMPT, 9], "stream": True, "stream_options": {"include_usage": True}}
        async with session.post(url, json=streamed) as response:
            assert response.status == 200 and response.headers["Content-Type"].startswith("text/event-stream")
            events = [line for line in (await response.text()).splitlines() if line.startswith("data: ")]
    assert first["usage"]["completion_tokens"] == 3
    assert events[-1] == "data: [DONE]"
    usage = json.loads(events[-2][len("data: ") :])["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == len(PROMPT)  # sent to the holder
    explained = await _explain(aiohttp_router.url, [*PROMPT, 9])
    assert explained["chosen"] == holder


async def _explain(url: str, prompt: list[int]) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
    async with (
        aiohttp.ClientSession(headers=_auth()) as session,
        session.post(url + "/debug/route", json=body) as response,
    ):
        assert response.status == 200, await response.text()
        return await response.json()


@pytest.mark.parametrize(
    ("method", "path", "headers", "data", "status", "kind"),
    [
        ("GET", "/nowhere", True, None, 404, "not_found_error"),
        ("GET", "/v1/completions", True, None, 405, "invalid_request_error"),
        ("POST", "/v1/completions", False, b"{}", 401, "authentication_error"),
        ("POST", "/v1/completions", True, b"x" * 5000, 413, "invalid_request_error"),
        ("POST", "/v1/completions", True, b"{not json", 400, "invalid_request_error"),
        ("POST", "/v1/completions", True, b'{"model": "nope", "prompt": [1]}', 404, "not_found_error"),
    ],
)
async def test_the_edge_rules_answer_in_openai_shape_and_the_router_keeps_serving(
    aiohttp_router, method, path, headers, data, status, kind
):
    async with aiohttp.ClientSession() as session:
        sent = {"Content-Type": "application/json", **(_auth() if headers else {})}
        async with session.request(method, aiohttp_router.url + path, data=data, headers=sent) as response:
            reply = await response.json(content_type=None)
        assert response.status == status, reply
        assert reply["error"]["type"] == kind and reply["error"]["code"] == status
        assert "\n" not in reply["error"]["message"]
        async with session.get(aiohttp_router.url + "/health") as response:
            assert response.status == 200


async def test_pipelined_requests_are_answered_in_order(aiohttp_router):
    body = json.dumps({"model": "tiny", "prompt": [*PROMPT, 11], "max_tokens": 1}).encode()
    auth = f"Authorization: Bearer {KEY}\r\n".encode()
    get = b"GET %s HTTP/1.1\r\nHost: r\r\n\r\n"
    pipelined = get % b"/health" + get % b"/nowhere" + completion("p-2", auth, body)
    replies = await exchange(_port(aiohttp_router), completion("p-1", auth, body), pipelined, replies=4)
    assert [status for status, _, _ in replies] == [200, 200, 404, 200]
    assert [replies[i][1]["X-Request-Id"] for i in (0, 3)] == ["p-1", "p-2"]
    assert json.loads(replies[3][2])["usage"]["completion_tokens"] == 1


async def test_the_command_line_picks_the_server_and_warns_of_the_deprecated_lean_front(redis_server, tmp_path):
    port = free_port()
    command = [sys.executable, "-m", "router", "--redis-url", redis_server.url, "--port", str(port)]
    command += ["--http-server", "aiohttp", "--no-lean-front", "--log-level", "WARNING"]
    with (tmp_path / "router.log").open("wb") as log:
        process = subprocess.Popen(command, cwd=ROOT, stderr=log)  # noqa: ASYNC220 - starting it does not block
    try:
        async with aiohttp.ClientSession() as session:
            served_by: list[str] = []

            async def healthy() -> bool:
                try:
                    async with session.get(f"http://127.0.0.1:{port}/health") as response:
                        served_by.append(response.headers.get("Server", ""))
                        return response.status == 200
                except aiohttp.ClientError:
                    return False

            await wait_until(healthy, 30)
        assert "aiohttp" in served_by[-1]
    finally:
        process.terminate()
        await asyncio.to_thread(process.wait, 30)
    warnings = [line for line in (tmp_path / "router.log").read_text().splitlines() if "lean-front" in line]
    assert len(warnings) == 1 and "deprecated and has no effect" in warnings[0], warnings


async def test_aiohttp_s_client_relays_streams_and_a_given_up_stream_aborts_the_engine_s_request(fleet, redis_server):
    context, router = await start_router(redis_server.url, upstream_client=UpstreamClientKind.AIOHTTP)
    try:
        await wait_for_workers(router, fleet.count)
        url = router.url + "/v1/completions"
        body = {"model": "tiny", "prompt": [*PROMPT, 13], "max_tokens": 8, "stream": True}
        async with aiohttp.ClientSession() as session:
            async with session.post(url, json=body) as response:
                assert response.status == 200
                events = [line for line in (await response.text()).splitlines() if line.startswith("data: ")]
            assert len(events) > 2 and events[-1] == "data: [DONE]"
            response = await session.post(url, json={**body, "max_tokens": 200})
            worker = response.headers["x-kvroute-worker"]
            await response.content.readline()  # the first event came: the engine is decoding
            response.close()  # the client goes away mid-stream
        engine = fleet.engine_of(worker).engine

        async def aborted() -> bool:  # the router closed its connection: the engine dropped the request
            return not engine.running and not engine.waiting

        await wait_until(aborted, 5)
    finally:
        await context.__aexit__(None, None, None)  # type: ignore[attr-defined]
