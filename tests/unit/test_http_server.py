"""router.http.server (and router.http.aiohttp_server, where marked) alone, over real HTTP, with
routes of the test's own: a bug in a handler is an OpenAI-shaped 500 naming the request id, logged
once with its traceback, and counted under its route; the route table's 404 and 405; an ``Expect:
100-continue`` answered before the body."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import pytest

from router.http.aiohttp_server import AiohttpServer
from router.http.edges import UNMATCHED, Admission, EdgeSettings
from router.http.routes import Routes
from router.http.server import HttpServer, ServerRules
from router.http.wire import HttpRequest, Reply

SERVERS = pytest.mark.parametrize("kind", [HttpServer, AiohttpServer], ids=["builtin", "aiohttp"])


@asynccontextmanager
async def serving(
    routes: Routes, counted: list[tuple[str, int]], kind: type[HttpServer | AiohttpServer] = HttpServer
) -> AsyncIterator[str]:
    rules = ServerRules(EdgeSettings(frozenset(), 1 << 20), header_timeout_s=5.0)
    server = kind(rules, routes, Admission(16), lambda route, status: counted.append((route, status)))
    port = await server.start("127.0.0.1", 0, reuse_port=False)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await server.shutdown(timeout_s=5)


@SERVERS
async def test_an_unexpected_error_is_an_openai_500_with_the_request_id(
    caplog: pytest.LogCaptureFixture, kind: type[HttpServer | AiohttpServer]
) -> None:
    async def broken(_: HttpRequest, reply: Reply) -> None:
        raise KeyError("a bug")

    routes = Routes()
    routes.get("/items", broken)
    counted: list[tuple[str, int]] = []
    caplog.set_level(logging.INFO)
    async with serving(routes, counted, kind) as url, aiohttp.ClientSession() as session:
        async with session.get(url + "/items", headers={"X-Request-Id": "req-42"}) as response:
            reply = await response.json()
        assert response.status == 500
        assert reply["error"] == {
            "message": "internal error in the router; its log has the details under request id req-42",
            "type": "internal_error",
            "param": None,
            "code": 500,
        }
    errors = [r for r in caplog.records if r.name == "router.errors"]
    assert len(errors) == 1 and errors[0].exc_info is not None and "req-42" in errors[0].getMessage()
    assert counted == [("/items", 500)]


@SERVERS
async def test_the_route_table_answers_404_and_405_in_openai_shape(kind: type[HttpServer | AiohttpServer]) -> None:
    async def hello(request: HttpRequest, reply: Reply) -> None:
        await reply.send_json({"query": request.query})

    routes = Routes()
    routes.get("/hello", hello)
    with pytest.raises(ValueError, match="has a handler already"):
        routes.get("/hello", hello)
    counted: list[tuple[str, int]] = []
    async with serving(routes, counted, kind) as url, aiohttp.ClientSession() as session:
        async with session.get(url + "/hello?a=1") as response:
            assert response.status == 200 and await response.json() == {"query": "a=1"}
        async with session.post(url + "/hello", data=b"x") as response:
            assert response.status == 405 and response.headers["Allow"] == "GET, HEAD"
            assert (await response.json())["error"]["message"] == "POST is not allowed on /hello; use GET, HEAD"
        async with session.get(url + "/elsewhere") as response:
            assert response.status == 404 and (await response.json())["error"]["type"] == "not_found_error"
    assert counted == [("/hello", 200), (UNMATCHED, 405), (UNMATCHED, 404)]


async def test_an_expect_100_continue_is_answered_before_the_body_is_sent() -> None:
    async def echo(request: HttpRequest, reply: Reply) -> None:
        await reply.send_whole(200, {"Content-Type": "application/octet-stream"}, request.body)

    routes = Routes()
    routes.post("/echo", echo)
    async with serving(routes, []) as url:
        reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
        try:
            writer.write(b"POST /echo HTTP/1.1\r\nHost: h\r\nExpect: 100-continue\r\nContent-Length: 4\r\n\r\n")
            assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10) == b"HTTP/1.1 100 Continue\r\n\r\n"
            writer.write(b"body")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert head.startswith(b"HTTP/1.1 200") and await reader.readexactly(4) == b"body"
        finally:
            writer.close()
