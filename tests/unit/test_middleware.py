"""router.middleware over real HTTP: a bug in a handler is an OpenAI-shaped 500 naming the
request id, logged once with its traceback, and counted under the route's pattern."""

from __future__ import annotations

import logging

import aiohttp
from aiohttp import web

from router.middleware import EdgeSettings, edge_middleware


async def test_an_unexpected_error_is_an_openai_500_with_the_request_id(caplog):
    counted: list[tuple[str, int]] = []
    middleware = edge_middleware(
        EdgeSettings(frozenset(), 1 << 20), lambda route, status: counted.append((route, status))
    )

    async def broken(_: web.Request) -> web.Response:
        raise KeyError("a bug")

    app = web.Application(middlewares=[middleware])
    app.router.add_get("/items/{name}", broken)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    caplog.set_level(logging.INFO)
    try:
        headers = {"X-Request-Id": "req-42"}
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{port}/items/x", headers=headers) as response,
        ):
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
        assert counted == [("/items/{name}", 500)]
    finally:
        await runner.cleanup()
