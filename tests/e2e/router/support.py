"""Fixtures and helpers of the router's end-to-end tests: real Redis, simulated engines (real
HTTP/ZMQ) and agent processes."""

from __future__ import annotations

import asyncio

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


async def wait_for_workers(router: RunningRouter, count: int) -> None:
    async def ready() -> bool:
        await router.state.fleet.refresh()
        return len(router.state.fleet.alive("tiny")) == count

    await wait_until(ready, 20)


async def wait_indexed(where: RunningRouter | RedisIndex, prompt: list[int], salt: str | None = None) -> str:
    """Wait until a worker holds all of ``prompt``'s full blocks in the index; that worker."""
    index = where.state.index if isinstance(where, RunningRouter) else where
    chain = sequence_hashes(prompt, 16, cache_salt=salt)
    holders: list[str] = []

    async def indexed() -> bool:
        matches = await index.match("tiny", chain)
        holders[:] = [worker for worker, blocks in matches.items() if blocks == len(chain)]
        return bool(holders)

    await wait_until(indexed, 10)
    return holders[0]


async def complete(url: str, prompt, **extra) -> tuple[int, dict, dict]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, **extra}
    async with aiohttp.ClientSession() as session, session.post(url + "/v1/completions", json=body) as response:
        return response.status, dict(response.headers), await response.json()


class Traffic:
    """Completions sent by ``clients`` concurrent loops until :meth:`stop`: every status kept,
    with the body of each failure, so that a fault test can assert that none failed."""

    def __init__(self, url: str, clients: int = 4) -> None:
        self.url = url
        self.clients = clients
        self.statuses: list[int] = []
        self.failures: list[tuple[int, dict]] = []
        self._stopping = False
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> Traffic:
        self._tasks = [asyncio.create_task(self._client(n)) for n in range(self.clients)]
        return self

    async def _client(self, n: int) -> None:
        async with aiohttp.ClientSession() as session:
            i = 0
            while not self._stopping:
                i += 1
                prompt = [*PREFIX[: 16 * (1 + i % 5)], n, i]
                body = {"model": "tiny", "prompt": prompt, "max_tokens": 2}
                async with session.post(self.url + "/v1/completions", json=body) as response:
                    reply = await response.json(content_type=None)
                self.statuses.append(response.status)
                if response.status != 200:
                    self.failures.append((response.status, reply))

    async def served_more(self, count: int, within: float = 30) -> None:
        """Wait until ``count`` more requests were answered (whatever their status)."""
        target = len(self.statuses) + count

        async def enough() -> bool:
            return len(self.statuses) >= target

        await wait_until(enough, within)

    async def stop(self) -> None:
        self._stopping = True
        for task in self._tasks:
            await task
