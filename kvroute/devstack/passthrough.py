"""A bare aiohttp pass-through proxy: the floor under ``kvroute bench router``'s added latency.

It forwards ``POST /v1/completions`` bodies to one upstream and returns the reply, with the same
client, server and event loop as the router but no decoding, tokenizing, hashing or Redis. What
the router adds beyond this is the cost of routing; what this adds is the cost of a Python hop.
Run as ``python -m kvroute.devstack.passthrough PORT UPSTREAM_URL``.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import aiohttp
from aiohttp import web

from kvroute.devstack.processes import serve_app
from kvservice.lifecycle import listening, run_service, serve_until_signal

PROG = "python -m kvroute.devstack.passthrough"
Handler = Callable[[web.Request], Awaitable[web.Response]]


async def completions_site(port: int, completions: Handler) -> web.AppRunner:
    """A local server with ``POST /v1/completions`` and ``GET /health``, started; the caller
    cleans the runner up."""

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    return await serve_app(app, port)


@asynccontextmanager
async def passthrough(port: int, upstream: str) -> AsyncIterator[web.AppRunner]:
    """The pass-through on ``port`` until the block exits."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def completions(request: web.Request) -> web.Response:
            body = await request.read()
            headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
            async with session.post(upstream + "/v1/completions", data=body, headers=headers) as reply:
                data = await reply.read()
                return web.Response(status=reply.status, body=data, content_type=reply.content_type)

        with listening("the pass-through", f"127.0.0.1:{port}", "PORT"):
            runner = await completions_site(port, completions)
        try:
            yield runner
        finally:
            await runner.cleanup()


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not argv[0].isdigit():
        print(f"usage: {PROG} PORT UPSTREAM_URL", file=sys.stderr)
        return 2
    port, upstream = int(argv[0]), argv[1].rstrip("/")
    return run_service(PROG, lambda: serve_until_signal(passthrough(port, upstream)))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
