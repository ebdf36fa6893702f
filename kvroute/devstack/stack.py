"""A whole kvroute stack on one machine: simulated engines, an agent per engine and router replicas,
each a process of its own. Used by ``kvroute demo``, ``kvroute bench replay`` and ``kvroute bench regimes``.

Every wait is on observable state (an engine's /health, the workers registered in Redis, a router
that sees every engine, the agents' emptied index after a cache reset), and a process that exits
while it is awaited ends the wait with the tail of its log. Everything started is stopped when the
``async with`` block exits, whatever the reason.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp

from kvindex.keys import KeySchema
from kvindex.redis_index import RedisIndex
from kvindex.roles import BOTH
from kvindex.settings import RedisSettings
from kvindex.tiers import GPU
from kvindex.types import WorkerRecord
from kvroute.devstack.embedded_redis import free_port
from kvroute.devstack.ports import LOWEST, claim, usable
from kvroute.devstack.processes import (
    agent_command,
    exited,
    poll_until,
    remove_files,
    start_logged,
    stop_processes,
    wait_healthy,
)
from kvroute.devstack.vllm import BLOCK_SIZE as VLLM_BLOCK_SIZE
from kvroute.devstack.vllm import VllmOptions, assemble_model, engine_core, vllm_command, vllm_env
from kvservice.metrics_page import read_metrics
from router.routing.scoring import Policy
from sim_engine.engine import TimingModel
from sim_engine.settings import EVENTS_PORT_OFFSET, TINY_MODEL_DIR

MODEL = "tiny"
TINY_PROMPT = [7, 8, 9]  # a request that publishes an engine's pending KV events
# vLLM 0.32's CPU worker dies on a prompt of 3 tokens (seen here: "Worker proc VllmWorker-0 died
# unexpectedly"); 20 tokens fill no block of 32 either
VLLM_TINY_PROMPT = list(range(10, 30))
VLLM_START_S = 600.0  # vLLM servers starting together on two cores: ~30 s each, one after another


@dataclass
class StreamedReply:
    """What a streamed completion through a router told us."""

    status: int
    text: str = ""  # the body, when the status is not 200
    ttft_s: float = 0.0  # time to the first streamed event
    usage: dict[str, Any] | None = None
    worker: str = ""  # x-kvroute-worker
    predicted_cached_tokens: int = 0  # x-kvroute-cached-tokens
    latency_s: float = 0.0  # time to the end of the reply
    predicted_known: bool = False  # the router sent x-kvroute-cached-tokens
    prefill_worker: str = ""  # x-kvroute-prefill-worker: the request was split (router.routing.pd)


def _reply(response: aiohttp.ClientResponse) -> StreamedReply:
    headers = response.headers  # peers (SGLang's router) send neither of kvroute's headers
    predicted = int(headers.get("x-kvroute-cached-tokens", 0))
    known = "x-kvroute-cached-tokens" in headers
    return StreamedReply(
        200,
        worker=headers.get("x-kvroute-worker", ""),
        predicted_cached_tokens=predicted,
        predicted_known=known,
        prefill_worker=headers.get("x-kvroute-prefill-worker", ""),
    )


async def stream_completion(session: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any]) -> StreamedReply:
    """POST ``body`` with streaming and usage on; time the first event and keep the usage."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    async with session.post(url + path, json=body) as response:
        if response.status != 200:
            return StreamedReply(response.status, text=(await response.text())[:300])
        reply = _reply(response)
        async for line in response.content:
            if not reply.ttft_s and line.startswith(b"data:"):
                reply.ttft_s = time.perf_counter() - started
            if line.startswith(b"data: {") and b'"usage"' in line:
                reply.usage = json.loads(line[6:]).get("usage") or reply.usage
    reply.latency_s = time.perf_counter() - started
    return reply


async def whole_completion(session: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any]) -> StreamedReply:
    """POST ``body`` without streaming: the client sees nothing before the whole reply, so only
    ``latency_s`` (time to the whole reply) is measured; ``ttft_s`` stays 0."""
    body = {**body, "stream": False}
    started = time.perf_counter()
    async with session.post(url + path, json=body) as response:
        if response.status != 200:
            return StreamedReply(response.status, text=(await response.text())[:300])
        reply = _reply(response)
        reply.usage = (await response.json()).get("usage")
    reply.latency_s = time.perf_counter() - started
    return reply


async def metric_value(
    session: aiohttp.ClientSession, base_url: str, name: str, path: str = "/metrics"
) -> float | None:
    """The first sample called ``name`` on ``base_url``'s Prometheus page (None: no such sample)."""
    return (await read_metrics(session, base_url + path)).value(name)


def scheduler_flags(timing: TimingModel) -> list[str]:
    """The engine's batch limit and, when the simulated engine has it, its per-step token budget
    (vLLM's ``--max-num-batched-tokens``, chunked prefill) and the limit under vLLM's name."""
    budget = getattr(timing, "max_num_batched_tokens", None)
    if budget is None:  # a simulated engine from before the token budget: --max-running only
        return ["--max-running", str(timing.max_running)]
    return ["--max-num-batched-tokens", str(budget), "--max-num-seqs", str(timing.max_running)]


@dataclass
class Child:
    """A process of the stack and the file its stderr goes to."""

    name: str
    process: subprocess.Popen[bytes]
    log: str

    def failure(self) -> Exception | None:
        return exited(self.process, self.log, self.name)


@dataclass
class EngineProcess(Child):
    url: str = ""
    events_port: int = 0
    replay_port: int = 0


@dataclass(frozen=True)
class CacheCensus:
    """Which blocks the engines' prefix caches hold, counted across engines."""

    per_engine: list[int]  # blocks each engine holds
    distinct: int  # distinct blocks held anywhere
    shared: int  # of those, blocks held by more than one engine

    @property
    def duplication(self) -> float:
        """Distinct cached blocks held by more than one engine, as a fraction of all distinct ones."""
        return self.shared / max(self.distinct, 1)


class Stack:
    def __init__(
        self,
        redis: RedisSettings,
        engines: int = 4,
        num_blocks: int = 512,
        block_size: int = 16,
        timing: TimingModel | None = None,
        max_model_len: int = 4096,
        engine_metrics: str = "full",
        cpu_blocks: int = 0,
        cpu_load_ms_per_1k_tokens: float = 4.0,
        disk_blocks: int = 0,
        disk_load_ms_per_1k_tokens: float = 30.0,
        roles: Sequence[str] = (),
        vllm: VllmOptions | None = None,
        shared_cores: float = 0.0,
    ) -> None:
        self.redis = redis
        # real vLLM servers (kvroute.devstack.vllm) instead of simulated engines: their cache and
        # scheduler limits (num_blocks, block_size and max_model_len above do not apply)
        self._vllm = vllm
        self._workdirs: list[str] = []
        # simulated engines sharing this many cores, as vLLM servers on one CPU (0: each its own),
        # through a directory made when they start
        self._shared_cores = shared_cores
        self._shared_compute: str | None = None
        # each engine's role in a prefill/decode split (kvindex/roles.py; () or missing: both); any
        # role but both starts every engine with a KV connector (--kv-transfer)
        self._roles = tuple(roles)
        # a CPU tier behind each engine's GPU cache, and a disk tier behind it (sim_engine/offload.py):
        # each tier's blocks (0: none) and load time per 1k tokens
        self._cpu = (cpu_blocks, cpu_load_ms_per_1k_tokens)
        self._disk = (disk_blocks, disk_load_ms_per_1k_tokens)
        self._engine_metrics = engine_metrics  # the engines' --metrics: full, or minimal (three gauges)
        self.engines = engines
        self._num_blocks = vllm.num_blocks if vllm else num_blocks
        self._block_size = VLLM_BLOCK_SIZE if vllm else block_size
        self._max_model_len = vllm.max_model_len if vllm else max_model_len
        self._timing = timing or TimingModel(prefill_ms_per_1k_tokens=200, decode_ms_per_step=5, step_overhead_ms=1)
        self.running: list[EngineProcess] = []
        self._agents: list[Child] = []
        self._routers: list[Child] = []
        self._ports: set[int] = set()
        self._logs: list[str] = []

    async def __aenter__(self) -> Stack:
        try:
            if self._shared_cores > 0 and self._vllm is None:
                self._shared_compute = self._workdir("kvroute-compute-")
            self.running = [self._start_engine(n) for n in range(self.engines)]
            within_s = VLLM_START_S if self._vllm else 60.0
            async with aiohttp.ClientSession() as session:
                for engine in self.running:
                    health = engine.url + "/health"
                    await wait_healthy(session, health, engine.process, engine.log, within_s, engine.name)
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

    def _start(self, name: str, command: list[str]) -> Child:
        process, log = start_logged(command, name.split()[0])  # kvroute-router-XXXX.log and the like
        self._logs.append(log)
        return Child(name, process, log)

    def _engine_port(self) -> int:
        """A free HTTP port whose default KV-event port is free too: the engine binds that one on
        loopback (a given endpoint is bound only as a wildcard, vLLM's rule)."""
        while True:
            port = self._port()
            events = port - EVENTS_PORT_OFFSET
            if events >= LOWEST and events not in self._ports and usable(events):
                claim(events)
                self._ports.add(events)
                return port

    def _start_engine(self, number: int) -> EngineProcess:
        if self._vllm is not None:
            return self._start_vllm(number, self._vllm)
        port, replay = self._engine_port(), self._port()
        events = port - EVENTS_PORT_OFFSET
        t = self._timing
        command = [sys.executable, "-m", "kvroute", "sim-engine", "--port", str(port), "--model", MODEL]
        command += ["--replay-endpoint", f"tcp://127.0.0.1:{replay}"]  # events: the default, on loopback
        command += ["--topic", "kv", "--num-blocks", str(self._num_blocks), "--block-size", str(self._block_size)]
        command += ["--max-model-len", str(self._max_model_len), *scheduler_flags(t)]
        command += ["--prefill-ms-per-1k-tokens", str(t.prefill_ms_per_1k_tokens)]
        command += ["--decode-ms-per-step", str(t.decode_ms_per_step), "--step-overhead-ms", str(t.step_overhead_ms)]
        command += ["--speedup", str(t.speedup), "--metrics", self._engine_metrics]
        if t.prefill_context_ns:
            command += ["--prefill-context-ns", str(t.prefill_context_ns)]
        if t.parallel_prefill:
            command += ["--parallel-prefill"]
        for tier, (blocks, load_ms) in (("cpu", self._cpu), ("disk", self._disk)):
            if blocks:
                command += [f"--{tier}-blocks", str(blocks), f"--{tier}-load-ms-per-1k-tokens", str(load_ms)]
        if any(role != BOTH for role in self._roles):
            command += ["--kv-transfer"]
        if self._shared_compute is not None:
            command += ["--shared-compute", self._shared_compute, "--shared-cores", f"{self._shared_cores:g}"]
        child = self._start(f"simulated engine {number}", command)
        return EngineProcess(child.name, child.process, child.log, f"http://127.0.0.1:{port}", events, replay)

    def _start_vllm(self, number: int, options: VllmOptions) -> EngineProcess:
        """A real vLLM server in a directory of its own (its model, caches and socket files)."""
        workdir = self._workdir("kvroute-vllm-")
        port, events, replay = self._port(), self._port(), self._port()
        command = vllm_command(assemble_model(Path(workdir)), port, events, replay, options)
        env = vllm_env(workdir, core=engine_core(number, options))
        process, log = start_logged(command, "vllm", env=env, cwd=workdir, stdout_too=True)
        self._logs.append(log)
        return EngineProcess(f"vLLM engine {number}", process, log, f"http://127.0.0.1:{port}", events, replay)

    def _workdir(self, prefix: str) -> str:
        """A temporary directory of this stack's, removed when it exits."""
        workdir = tempfile.mkdtemp(prefix=prefix)
        self._workdirs.append(workdir)
        return workdir

    def _start_agent(self, engine: EngineProcess) -> Child:
        command = agent_command(
            engine.url,
            f"tcp://127.0.0.1:{engine.events_port}",
            replay=f"tcp://127.0.0.1:{engine.replay_port}",
            redis_url=self.redis.url,
            prefix=self.redis.prefix,
            # as an operator would: an engine with --metrics minimal does not say its block size
            block_size=self._block_size,
            role=self._role(engine),
        )
        return self._start(f"agent of {engine.name}", command)

    def _role(self, engine: EngineProcess) -> str | None:
        number = self.running.index(engine)
        return self._roles[number] if number < len(self._roles) else None

    def _raise_if_any_exited(self, children: list[Child]) -> None:
        for child in children:
            if (failure := child.failure()) is not None:
                raise failure

    async def _index_workers(
        self, check: Callable[[list[WorkerRecord]], bool], what: str, within_s: float = 60.0
    ) -> None:
        """Poll ``check(this stack's alive workers)`` until True; an agent that exits ends the wait.
        (A Redis given by the user may list other stacks' workers: they are not looked at.)"""
        client = self.redis.client()
        index = RedisIndex(client, KeySchema(self.redis.prefix))
        ours = set(self.engine_urls)

        async def done() -> bool:
            self._raise_if_any_exited(self._agents)
            return check([w for w in await index.workers(MODEL) if w.alive and w.url.rstrip("/") in ours])

        try:
            await poll_until(done, what, within_s)
        finally:
            await client.aclose()

    async def _wait_registered(self) -> None:
        await self._index_workers(
            lambda workers: sum(w.tier == GPU for w in workers) >= self.engines,
            f"the {self.engines} agents did not register",
        )

    async def start_routers(self, policy: Policy, replicas: int = 2, flags: Sequence[str] = ()) -> list[str]:
        """``replicas`` router processes (each its own interpreter, as deployed), ready and seeing
        every engine; their URLs. ``flags``: more router flags (--tier-cost ...)."""
        started = [self._start_router(policy, n, flags) for n in range(replicas)]
        self._routers += [child for child, _ in started]
        async with aiohttp.ClientSession() as session:
            for child, url in started:
                await self._wait_router(session, child, url)
        return [url for _, url in started]

    def _start_router(self, policy: Policy, number: int, flags: Sequence[str] = ()) -> tuple[Child, str]:
        port = self._port()
        command = [sys.executable, "-m", "router", "--redis-url", self.redis.url, "--prefix", self.redis.prefix]
        command += ["--port", str(port), "--policy", policy.value, "--replica-id", f"stack-{number}-{port}"]
        command += ["--tokenizer", f"{MODEL}={TINY_MODEL_DIR}", "--log-level", "WARNING"]
        command += ["--enable-debug", *self._tier_flags(), *flags]  # _wait_router reads /debug/route
        return self._start(f"router replica {number}", command), f"http://127.0.0.1:{port}"

    def _tier_flags(self) -> list[str]:
        """The engines' lower tiers' load times, as an operator sets them for the hardware (in the
        routers' wall clock: the engines run ``speedup`` times faster than real time)."""
        tiers = (("CPU", self._cpu), ("DISK", self._disk))
        loads = [f"{tier}={ms / self._timing.speedup:.6g}" for tier, (blocks, ms) in tiers if blocks]
        return ["--tier-load-ms", ",".join(loads)] if loads else []

    async def _wait_router(self, session: aiohttp.ClientSession, router: Child, url: str) -> None:
        """Until the router's /debug/route lists every engine (it sees the whole fleet)."""
        probe = {"model": MODEL, "prompt": [1, 2, 3]}

        async def sees_every_engine() -> bool:
            self._raise_if_any_exited([router])
            try:
                async with session.post(url + "/debug/route", json=probe) as response:
                    return response.status == 200 and len((await response.json())["workers"]) >= self.engines
            except aiohttp.ClientError:
                return False

        await poll_until(sees_every_engine, f"{router.name} at {url} did not see the {self.engines} engines")

    async def stop_routers(self) -> None:
        routers, self._routers = self._routers, []
        stop_processes(child.process for child in routers)

    async def reset_caches(self, forget_learned: bool = True) -> None:
        """Empty every engine's prefix cache, and wait until the agents have emptied the index too:
        a tiny request per engine publishes the clear (it caches a block only when blocks are tiny).
        ``forget_learned``: the cost model the routers learned goes too (else the next run's
        routers start from it, as a deployment's new replicas do)."""
        async with aiohttp.ClientSession() as session:
            for engine in self.running:
                async with session.post(engine.url + "/reset_prefix_cache") as response:
                    response.raise_for_status()
                body = {"model": MODEL, "prompt": self._tiny_prompt, "max_tokens": 1}
                async with session.post(engine.url + "/v1/completions", json=body) as response:
                    response.raise_for_status()
        tiny_blocks = (len(self._tiny_prompt) + 1) // self._block_size  # its prompt and output token
        await self._index_workers(
            # the workers, and their lower tiers' holders (kvindex/tiers.py) emptied too
            lambda workers: (
                sum(w.tier == GPU for w in workers) == self.engines and all(w.blocks <= tiny_blocks for w in workers)
            ),
            "the agents did not apply the cache resets",
        )
        await self._forget_routing_state(forget_learned)

    async def _forget_routing_state(self, forget_learned: bool) -> None:
        """The routers' "expected" prefixes of the run before (kept a few seconds) would steer the
        next run's first requests to where the previous run sent them, and the cost model they
        learned would start the next run's routers warm: a run starts from nothing (unless
        ``forget_learned`` is False: then only the expected prefixes go)."""
        keys = KeySchema(self.redis.prefix).for_model(MODEL)
        learned = (keys.learned, keys.learned_at) if forget_learned else ()
        client = self.redis.client()
        try:
            await client.delete(keys.expected, keys.expected_deadlines, *learned)
        finally:
            await client.aclose()

    @property
    def _tiny_prompt(self) -> list[int]:
        return VLLM_TINY_PROMPT if self._vllm else TINY_PROMPT

    @property
    def num_blocks(self) -> int:
        """Each engine's KV cache in blocks (the null block included)."""
        return self._num_blocks

    @property
    def engine_urls(self) -> list[str]:
        return [engine.url for engine in self.running]

    async def requests_per_engine(self) -> list[int]:
        """Each engine's finished requests so far (its ``vllm:request_success`` counter)."""
        return [int(n) for n in await self.engine_metric("vllm:request_success_total")]

    async def engine_metric(self, name: str) -> list[float]:
        """Each engine's samples called ``name`` now, summed over their labels (0 where it has none),
        from its whole metric set (a simulated engine's ``/debug/metrics``: one started with
        ``--metrics minimal`` exports little on /metrics; vLLM's /metrics, whose
        ``vllm:request_success_total`` has a sample per finish reason)."""
        path = "/metrics" if self._vllm else "/debug/metrics"
        values = []
        async with aiohttp.ClientSession() as session:
            for engine in self.running:
                values.append((await read_metrics(session, engine.url + path)).total(name))
        return values

    async def cache_census(self) -> CacheCensus:
        """The blocks in every engine's prefix cache now (the engines' own /debug/cache)."""
        holders: Counter[str] = Counter()
        per_engine = []
        async with aiohttp.ClientSession() as session:
            for engine in self.running:
                async with session.get(engine.url + "/debug/cache") as response:
                    blocks = set((await response.json())["cached_blocks"])
                per_engine.append(len(blocks))
                holders.update(blocks)
        return CacheCensus(per_engine, len(holders), sum(1 for n in holders.values() if n > 1))

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        children = [*self._routers, *self._agents, *self.running]
        stop_processes(child.process for child in children)
        self._routers = []
        remove_files(self._logs)
        for workdir in self._workdirs:
            shutil.rmtree(workdir, ignore_errors=True)
