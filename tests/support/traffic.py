"""Shared-prefix traffic for the tests that break things under load (the router suite's and the
fault suite's): a few workers that keep sending completions through the routers and count every
request that does not come back 200."""

from __future__ import annotations

import asyncio
import contextlib
import random
from dataclasses import dataclass, field

import aiohttp

from tests.support import wait_until

BLOCK = 16
PREFIX_BLOCKS = 8


def make_prefixes(count: int, seed: int = 13) -> list[list[int]]:
    """``count`` distinct prompts of PREFIX_BLOCKS full blocks (the tenants' system prompts)."""
    rng = random.Random(seed)
    return [[rng.randrange(10, 1900) for _ in range(PREFIX_BLOCKS * BLOCK)] for _ in range(count)]


@dataclass
class Traffic:
    """Completions of ``prefix + a unique suffix`` sent round robin to ``urls`` by ``concurrency``
    workers; :meth:`pause` waits for the requests in flight, :meth:`resume` goes on."""

    urls: list[str]
    prefixes: list[list[int]]
    concurrency: int = 2
    seed: int = 7
    sent: int = 0
    failed: int = 0
    failures: list[str] = field(default_factory=list)  # the first few reasons, for the assertion message
    in_flight: int = 0
    _running: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _session: aiohttp.ClientSession | None = None

    @property
    def completed(self) -> int:
        return self.sent - self.in_flight

    def start(self) -> Traffic:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))
        self._running.set()
        self._tasks = [asyncio.create_task(self._worker(i)) for i in range(self.concurrency)]
        return self

    async def _worker(self, worker: int) -> None:
        rng = random.Random(self.seed * 1000 + worker)
        turn = 0
        while True:
            await self._running.wait()
            url = self.urls[(worker + turn) % len(self.urls)]
            turn += 1
            prompt = rng.choice(self.prefixes) + [rng.randrange(10, 1900) for _ in range(rng.randrange(4, 30))]
            self.sent += 1
            self.in_flight += 1
            try:
                await self._send(url, prompt)
            finally:
                self.in_flight -= 1

    async def _send(self, url: str, prompt: list[int]) -> None:
        assert self._session is not None
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 2}
        try:
            async with self._session.post(url + "/v1/completions", json=body) as response:
                text = await response.text()
                if response.status != 200:
                    self._fail(f"{url}: {response.status} {text[:200]}")
        except (aiohttp.ClientError, TimeoutError) as exc:
            self._fail(f"{url}: {type(exc).__name__}: {exc}")

    def _fail(self, why: str) -> None:
        self.failed += 1
        if len(self.failures) < 10:
            self.failures.append(why)

    async def progressed(self, requests: int, within: float = 30.0) -> None:
        """Wait until ``requests`` more requests have completed (traffic went on through a fault)."""
        target = self.completed + requests

        async def done() -> bool:
            return self.completed >= target

        await wait_until(done, within)

    async def pause(self) -> None:
        self._running.clear()

        async def idle() -> bool:
            return self.in_flight == 0

        await wait_until(idle, 60)

    def resume(self) -> None:
        self._running.set()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._session is not None:
            await self._session.close()
