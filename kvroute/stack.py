"""A whole kvroute stack on one machine: simulated engines (in this process), an agent process per
engine, and router replicas (in this process). Used by ``kvroute demo`` and the benchmarks.

Everything started is stopped when the ``async with`` block exits, whatever the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import subprocess
import sys
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Any

import aiohttp

from kvindex.keys import KeySchema
from kvindex.redis_index import RedisIndex
from kvindex.settings import RedisSettings
from router.main import RunningRouter, running_router
from router.scoring import Policy
from router.settings import RouterSettings
from sim_engine.engine import TimingModel
from sim_engine.server import RunningEngine, running_engine
from sim_engine.settings import SimEngineSettings

MODEL = "tiny"


class Stack:
    def __init__(self, redis: RedisSettings, engines: int = 4, num_blocks: int = 512, block_size: int = 16,
                 timing: TimingModel | None = None, max_model_len: int = 4096) -> None:  # fmt: skip
        self.redis = redis
        self.engines = engines
        self._num_blocks = num_blocks
        self._block_size = block_size
        self._max_model_len = max_model_len
        self._timing = timing or TimingModel(prefill_ms_per_1k_tokens=200, decode_ms_per_step=5, step_overhead_ms=1)
        self.running: list[RunningEngine] = []
        self._engine_contexts: list[AbstractAsyncContextManager[RunningEngine]] = []
        self._agents: list[subprocess.Popen[bytes]] = []
        self._routers: list[tuple[AbstractAsyncContextManager[RunningRouter], RunningRouter]] = []

    async def __aenter__(self) -> Stack:
        try:
            for _ in range(self.engines):
                settings = SimEngineSettings(port=0, events_endpoint="tcp://127.0.0.1:*",
                                             replay_endpoint="tcp://127.0.0.1:*", topic="kv", model=MODEL,
                                             num_blocks=self._num_blocks, block_size=self._block_size,
                                             timing=self._timing, max_model_len=self._max_model_len)  # fmt: skip
                context = running_engine(settings)
                self.running.append(await context.__aenter__())
                self._engine_contexts.append(context)
            for engine in self.running:
                self._agents.append(self._start_agent(engine))
            await self._wait_registered()
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    def _start_agent(self, engine: RunningEngine) -> subprocess.Popen[bytes]:
        command = [sys.executable, "-m", "worker_agent", "--engine-url", engine.url, "--events",
                   str(engine.events_endpoint), "--replay", str(engine.replay_endpoint), "--topic", "kv",
                   "--redis-url", self.redis.url, "--prefix", self.redis.prefix, "--log-level", "WARNING"]  # fmt: skip
        return subprocess.Popen(command)

    async def _wait_registered(self, within: float = 60.0) -> None:
        client = self.redis.client()
        index = RedisIndex(client, KeySchema(self.redis.prefix))
        try:
            async with asyncio.timeout(within):
                for _ in itertools.count():  # poll: registration happens in other processes
                    if len([w for w in await index.workers(MODEL) if w.alive]) >= self.engines:
                        break
                    await asyncio.sleep(0.1)
        finally:
            await client.aclose()

    async def start_routers(self, policy: Policy, replicas: int = 2) -> list[str]:
        for _ in range(replicas):
            context = running_router(RouterSettings(redis=self.redis, port=0, policy=policy))
            running = await context.__aenter__()
            self._routers.append((context, running))
            async with asyncio.timeout(30):
                while len(running.state.fleet.alive(MODEL)) < self.engines:
                    await asyncio.sleep(0.1)
                    await running.state.fleet.refresh()
        return [running.url for _, running in self._routers]

    async def stop_routers(self) -> None:
        while self._routers:
            context, _ = self._routers.pop()
            await context.__aexit__(None, None, None)

    async def reset_caches(self) -> None:
        """Empty every engine's prefix cache; a tiny request per engine publishes the clear."""
        async with aiohttp.ClientSession() as session:
            for engine in self.running:
                async with session.post(engine.url + "/reset_prefix_cache") as response:
                    response.raise_for_status()
                body = {"model": MODEL, "prompt": [7, 8, 9], "max_tokens": 1}
                async with session.post(engine.url + "/v1/completions", json=body) as response:
                    response.raise_for_status()
        await asyncio.sleep(0.5)  # the agents apply the clears

    def duplication(self) -> float:
        """Distinct cached blocks held by more than one engine, as a fraction of all distinct ones."""
        holders: dict[int, int] = {}
        for engine in self.running:
            for block_hash in engine.engine.pool.cached_hashes():
                holders[block_hash] = holders.get(block_hash, 0) + 1
        return sum(1 for n in holders.values() if n > 1) / max(len(holders), 1)

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> Any:  # fmt: skip
        with contextlib.suppress(Exception):
            await self.stop_routers()
        for agent in self._agents:
            agent.terminate()
        for agent in self._agents:
            try:
                agent.wait(10)
            except subprocess.TimeoutExpired:
                agent.kill()
        for context in reversed(self._engine_contexts):
            with contextlib.suppress(Exception):
                await context.__aexit__(None, None, None)
        return None
