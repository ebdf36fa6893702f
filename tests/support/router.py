"""Fixtures and helpers of the router's end-to-end tests: real Redis, simulated engines (real
HTTP/ZMQ) and agent processes."""

from __future__ import annotations

import aiohttp

from kvindex.hashing import sequence_hashes
from kvindex.redis_index import RedisIndex
from kvindex.settings import RedisSettings
from router.main import RunningRouter, running_router
from router.settings import RouterSettings
from tests.support import wait_until

PREFIX = [(i * 7) % 1900 + 10 for i in range(160)]  # 10 blocks of 16


async def start_router(redis_url: str, **settings) -> tuple[object, RunningRouter]:
    # Routing tests get a generous Redis budget: on a loaded machine a 50 ms budget sends some
    # decisions to degraded round robin, which is tested on its own (test_redis_killed_...).
    settings.setdefault("redis_timeout_s", 2.0)
    settings.setdefault("enable_debug", True)  # the tests read /debug/route (off by default)
    context = running_router(RouterSettings(redis=RedisSettings(url=redis_url), port=0, **settings))
    return context, await context.__aenter__()


async def wait_indexed(where: RunningRouter | RedisIndex, prompt: list[int], salt: str | None = None) -> str:
    """Wait until a worker holds all of ``prompt``'s full blocks in the index; that worker."""
    chain = sequence_hashes(prompt, 16, cache_salt=salt)
    holders: list[str] = []

    async def indexed() -> bool:
        if isinstance(where, RunningRouter):  # through the router's own port onto the index
            matches = (await where.state.index.lookup("tiny", chain)).matches
        else:
            matches = await where.match("tiny", chain)
        holders[:] = [worker for worker, blocks in matches.items() if blocks == len(chain)]
        return bool(holders)

    await wait_until(indexed, 10)
    return holders[0]


async def complete(url: str, prompt, **extra) -> tuple[int, dict, dict]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, **extra}
    async with aiohttp.ClientSession() as session, session.post(url + "/v1/completions", json=body) as response:
        return response.status, dict(response.headers), await response.json()
