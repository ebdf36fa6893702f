"""``kvroute bench path``: the files of the project one completion passes through in the router,
and how often it comes back to a file it has already left (issue 56's targets: at most 20 files,
at most 30 returns).

How it counts. One router runs in this process beside a private Redis and a trivial upstream
registered as two workers. After warm-up requests (first-use set-ups are not the path), each
counted completion (token ids, not streamed, the kv policy) is sent while ``sys.setprofile``
records every Python function of the router's packages (``router``, ``kvindex``, ``kvservice``,
``kvtokens``) that is entered or resumed (a coroutine's resumption is a ``call`` event too), from
the request's send until its reply is read. The run of files entered, consecutive repeats merged,
gives the **files** (distinct) and the **returns** (entries into a file visited before and left
since). The client, the upstream and third-party libraries are not counted. Each run is one line
of JSON; the least of the runs is the figure (a background loop that ticks during a run adds to
it, never takes away).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

import aiohttp
from aiohttp import web

from kvindex.redis_index import RedisIndex
from kvindex.settings import RedisSettings
from kvindex.types import WorkerInfo
from kvroute.devstack.embedded_redis import RedisServer, free_port
from kvroute.devstack.processes import serve_app
from router.main import running_router
from router.settings import RouterSettings

ROOT = Path(__file__).resolve().parents[2]
COUNTED = tuple(str(ROOT / package) + "/" for package in ("router", "kvindex", "kvservice", "kvtokens"))
MODEL = "tiny"
REPLY = {
    "id": "cmpl-path",
    "object": "text_completion",
    "model": MODEL,
    "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}


class FileTrail:
    """The project files entered, in order, while recording."""

    def __init__(self) -> None:
        self.entered: list[str] = []

    def profile(self, frame: FrameType, event: str, _arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(COUNTED):
            path = frame.f_code.co_filename[len(str(ROOT)) + 1 :]
            if not self.entered or self.entered[-1] != path:
                self.entered.append(path)

    def figures(self) -> dict[str, Any]:
        seen: set[str] = set()
        returns = Counter[str]()
        for path in self.entered:
            if path in seen:
                returns[path] += 1
            seen.add(path)
        return {
            "files": len(seen),
            "returns": sum(returns.values()),
            "most_returned": dict(returns.most_common(5)),
            "trail": self.entered,
        }


async def _upstream(port: int) -> web.AppRunner:
    async def completions(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response(REPLY)

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    return await serve_app(app, port)


async def _one(session: aiohttp.ClientSession, url: str, prompt: list[int], trail: FileTrail | None) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    if trail is not None:
        sys.setprofile(trail.profile)
    try:
        async with session.post(url + "/v1/completions", json=body) as reply:
            await reply.read()
            reply.raise_for_status()
    finally:
        sys.setprofile(None)


async def run_benchmark(redis_url: str, args: argparse.Namespace) -> None:
    ports = [free_port(), free_port()]
    upstreams = [await _upstream(port) for port in ports]
    client = RedisSettings(url=redis_url).client()
    index = RedisIndex(client)
    for i, port in enumerate(ports):
        await index.register(WorkerInfo(f"w{i}", MODEL, f"http://127.0.0.1:{port}", 16), ttl_ms=600_000)
    settings = RouterSettings(redis=RedisSettings(url=redis_url), port=0, model_sync_ms=0, workers_refresh_s=60.0)
    try:
        async with running_router(settings) as router, aiohttp.ClientSession() as session:
            prompt = list(range(1, args.prompt_tokens + 1))
            for i in range(args.warmup):
                await _one(session, router.url, [i + 1_000_000, *prompt], None)
            for run in range(args.runs):
                trail = FileTrail()
                await _one(session, router.url, [run + 2_000_000, *prompt], trail)
                figures = trail.figures()
                if not args.trail:
                    figures.pop("trail")
                print(json.dumps({"run": run, "prompt_tokens": args.prompt_tokens + 1, **figures}), flush=True)
    finally:
        await client.aclose()
        for upstream in upstreams:
            await upstream.cleanup()


def run_from_args(args: argparse.Namespace) -> int:
    with RedisServer().start() as server:
        asyncio.run(run_benchmark(server.url, args))
    return 0
