"""A whole kvroute stack on one machine: simulated engines, an agent per engine and router replicas,
each a process of its own. Used by ``kvroute demo`` and ``kvroute bench replay``.

Everything started is stopped when the ``async with`` block exits, whatever the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvindex.keys import KeySchema
from kvindex.redis_index import RedisIndex
from kvindex.settings import RedisSettings
from kvroute.embedded_redis import free_port
from router.scoring import Policy
from sim_engine.engine import TimingModel
from sim_engine.settings import TINY_MODEL_DIR

MODEL = "tiny"


@dataclass
class StreamedReply:
    """What a streamed completion through a router told us."""

    status: int
    text: str = ""  # the body, when the status is not 200
    ttft_s: float = 0.0  # time to the first streamed event
    usage: dict[str, Any] | None = None
    worker: str = ""  # x-kvroute-worker
    predicted_cached_tokens: int = 0  # x-kvroute-cached-tokens


async def stream_completion(session: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any]) -> StreamedReply:
    """POST ``body`` with streaming and usage on; time the first event and keep the usage."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    async with session.post(url + path, json=body) as response:
        if response.status != 200:
            return StreamedReply(response.status, text=(await response.text())[:300])
        headers = response.headers  # peers (SGLang's router) send neither of kvroute's headers
        reply = StreamedReply(200, worker=headers.get("x-kvroute-worker", ""),
                              predicted_cached_tokens=int(headers.get("x-kvroute-cached-tokens", 0)))  # fmt: skip
        async for line in response.content:
            if not reply.ttft_s and line.startswith(b"data:"):
                reply.ttft_s = time.perf_counter() - started
            if line.startswith(b"data: {") and b'"usage"' in line:
                reply.usage = json.loads(line[6:]).get("usage") or reply.usage
    return reply


async def metric_value(session: aiohttp.ClientSession, base_url: str, name: str) -> float | None:
    """The first sample called ``name`` on ``base_url``'s Prometheus page (None: no such sample)."""
    async with session.get(base_url + "/metrics") as response:
        text = await response.text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    return None


@dataclass
class EngineProcess:
    url: str
    events_port: int
    replay_port: int
    process: subprocess.Popen[bytes]
    log: str


class Stack:
    def __init__(self, redis: RedisSettings, engines: int = 4, num_blocks: int = 512, block_size: int = 16,
                 timing: TimingModel | None = None, max_model_len: int = 4096) -> None:  # fmt: skip
        self.redis = redis
        self.engines = engines
        self._num_blocks = num_blocks
        self._block_size = block_size
        self._max_model_len = max_model_len
        self._timing = timing or TimingModel(prefill_ms_per_1k_tokens=200, decode_ms_per_step=5, step_overhead_ms=1)
        self.running: list[EngineProcess] = []
        self._agents: list[subprocess.Popen[bytes]] = []
        self._routers: list[subprocess.Popen[bytes]] = []
        self._ports: set[int] = set()

    async def __aenter__(self) -> Stack:
        try:
            self.running = [self._start_engine() for _ in range(self.engines)]
            await self._wait_engines()
            self._agents = [self._start_agent(engine) for engine in self.running]
            await self._wait_registered()
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    def _port(self) -> int:
        """A free port not handed to another process of this stack yet (free_port() may repeat)."""
        while (port := free_port()) in self._ports:
            pass
        self._ports.add(port)
        return port

    def _start_engine(self) -> EngineProcess:
        port, events, replay = self._port(), self._port(), self._port()
        t = self._timing
        command = [sys.executable, "-m", "kvroute", "sim-engine", "--port", str(port), "--model", MODEL,
                   "--events-endpoint", f"tcp://*:{events}", "--replay-endpoint", f"tcp://*:{replay}", "--topic", "kv",
                   "--num-blocks", str(self._num_blocks), "--block-size", str(self._block_size),
                   "--max-model-len", str(self._max_model_len), "--max-running", str(t.max_running),
                   "--prefill-ms-per-1k-tokens", str(t.prefill_ms_per_1k_tokens),
                   "--decode-ms-per-step", str(t.decode_ms_per_step), "--step-overhead-ms", str(t.step_overhead_ms),
                   "--speedup", str(t.speedup)]  # fmt: skip
        log = tempfile.NamedTemporaryFile(prefix="kvroute-sim-", suffix=".log", delete=False)  # noqa: SIM115
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)
        log.close()
        return EngineProcess(f"http://127.0.0.1:{port}", events, replay, process, log.name)

    async def _wait_engines(self, within: float = 60.0) -> None:
        async with aiohttp.ClientSession() as session, asyncio.timeout(within):
            for engine in self.running:
                for _ in itertools.count():  # poll: the engine starts in another process
                    if engine.process.poll() is not None:
                        tail = _tail(engine.log)
                        raise RuntimeError(f"a simulated engine exited with {engine.process.returncode}:\n{tail}")
                    with contextlib.suppress(aiohttp.ClientError):
                        async with session.get(engine.url + "/health") as response:
                            if response.status == 200:
                                break
                    await asyncio.sleep(0.1)

    def _start_agent(self, engine: EngineProcess) -> subprocess.Popen[bytes]:
        command = [sys.executable, "-m", "worker_agent", "--engine-url", engine.url,
                   "--events", f"tcp://127.0.0.1:{engine.events_port}",
                   "--replay", f"tcp://127.0.0.1:{engine.replay_port}", "--topic", "kv",
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
        """``replicas`` router processes (each its own interpreter, as deployed), ready and seeing
        every engine; their URLs."""
        started = [self._start_router(policy, n) for n in range(replicas)]
        self._routers += [process for process, _ in started]
        urls = [url for _, url in started]
        await self._wait_routers(urls)
        return urls

    def _start_router(self, policy: Policy, number: int) -> tuple[subprocess.Popen[bytes], str]:
        port = self._port()
        command = [sys.executable, "-m", "router", "--redis-url", self.redis.url, "--prefix", self.redis.prefix,
                   "--port", str(port), "--policy", policy.value, "--replica-id", f"stack-{number}-{port}",
                   "--tokenizer", f"{MODEL}={TINY_MODEL_DIR}", "--log-level", "WARNING"]  # fmt: skip
        return subprocess.Popen(command), f"http://127.0.0.1:{port}"

    async def _wait_routers(self, urls: list[str], within: float = 60.0) -> None:
        probe = {"model": MODEL, "prompt": [1, 2, 3]}
        async with aiohttp.ClientSession() as session, asyncio.timeout(within):
            for url in urls:
                for _ in itertools.count():  # poll: until the router sees every engine
                    with contextlib.suppress(aiohttp.ClientError):
                        async with session.post(url + "/debug/route", json=probe) as response:
                            if response.status == 200 and len((await response.json())["workers"]) >= self.engines:
                                break
                    await asyncio.sleep(0.1)

    async def stop_routers(self) -> None:
        routers, self._routers = self._routers, []
        _stop(routers)

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

    @property
    def engine_urls(self) -> list[str]:
        return [engine.url for engine in self.running]

    async def requests_per_engine(self) -> list[int]:
        """Each engine's finished requests so far (its ``vllm:request_success`` counter)."""
        counts = []
        async with aiohttp.ClientSession() as session:
            for engine in self.running:
                counts.append(int(await metric_value(session, engine.url, "vllm:request_success_total") or 0))
        return counts

    async def duplication(self) -> float:
        """Distinct cached blocks held by more than one engine, as a fraction of all distinct ones."""
        holders: dict[str, int] = {}
        async with aiohttp.ClientSession() as session:
            for engine in self.running:
                async with session.get(engine.url + "/debug/cache") as response:
                    for block in (await response.json())["cached_blocks"]:
                        holders[block] = holders.get(block, 0) + 1
        return sum(1 for n in holders.values() if n > 1) / max(len(holders), 1)

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> Any:  # fmt: skip
        _stop([*self._routers, *self._agents, *(engine.process for engine in self.running)])
        self._routers = []
        _remove([engine.log for engine in self.running])
        return None


def _stop(children: list[subprocess.Popen[bytes]]) -> None:
    for child in children:
        child.terminate()
    for child in children:
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            child.kill()


def _tail(path: str) -> str:
    return Path(path).read_text(errors="replace")[-2000:]


def _remove(paths: list[str]) -> None:
    for path in paths:
        Path(path).unlink(missing_ok=True)
