"""The tests' helpers, written once, in this one package: waiting on state (``wait_until``,
``wait_for_workers``), engines and agents as real processes, sockets and HTTP. Beside this module:
``router`` (a router in-process, its requests), ``cluster`` and ``cluster_fixtures`` (Redis
Cluster), ``agent`` (the agent's engine stand-in events), ``proxy`` (a TCP proxy that slows or
cuts a link), ``traffic`` (load through routers while things break), ``toy_engine`` (a pure
engine for the translator's tests), ``fake_worker`` (scripted workers behind a router), ``tls``
(certificates and a TLS Redis), ``vllm`` (a real vLLM on the CPU) and ``hybrid`` (a hybrid
model's requests, for a real vLLM and the simulated engine alike).

``EngineStandIn`` is the part of an engine the agent talks to (the KV-event publisher from
``sim_engine`` plus /health, /metrics and /v1/models over real HTTP), with knobs to make it
fail. ``AgentProcess`` runs ``python -m worker_agent`` as a subprocess and reads its /metrics.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import zmq.asyncio
from aiohttp import web

from kvindex.calls import SPECS, ScriptCall
from kvroute.devstack.embedded_redis import free_port
from kvroute.devstack.processes import ProcessFailed, poll_until
from kvservice.metrics_page import read_metrics
from router.upstream.split import prefill_body
from sim_engine.kv_events import KVEventPublisher

if TYPE_CHECKING:
    from router.main import RunningRouter

ROOT = Path(__file__).resolve().parents[2]


async def wait_until(check: Callable[[], Awaitable[bool]], within: float = 10.0, interval: float = 0.05) -> float:
    """Poll ``check`` until it returns True (the dev stack's :func:`poll_until`); the seconds it
    took. Fails the test (AssertionError) on timeout."""
    try:
        return await poll_until(check, "condition not met", within, interval)
    except ProcessFailed as exc:
        raise AssertionError(str(exc)) from None


async def wait_for_workers(
    router: RunningRouter, count: int, model: str = "tiny", within: float = 30, fleet: SimFleet | None = None
) -> None:
    """Until the router sees ``count`` workers of ``model`` alive (failing with ``fleet``'s agents'
    states and logs, when given)."""

    async def ready() -> bool:
        await router.state.fleet.refresh()
        return len(router.state.fleet.alive(model)) == count

    try:
        await wait_until(ready, within)
    except AssertionError as exc:
        alive = sorted(worker.worker_id for worker in router.state.fleet.alive(model))
        report = f"\n{fleet.agents_report()}" if fleet is not None else ""
        raise AssertionError(f"{exc}: {len(alive)} of {count} workers alive {alive}{report}") from None


@dataclass
class EngineStandIn:
    model: str
    block_size: int = 4
    healthy: bool = True
    load: tuple[int, int, float] = (0, 0, 0.0)
    num_gpu_blocks: int | None = None  # the KV-cache size its /metrics reports (vLLM's cache_config_info)
    adapters: list[str] = field(default_factory=list)  # LoRA adapters /v1/models lists, as vLLM does
    port: int = field(default_factory=free_port)
    publisher: KVEventPublisher | None = None
    _runner: web.AppRunner | None = None
    _context: zmq.asyncio.Context | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, replay: bool = True, events_endpoint: str = "tcp://127.0.0.1:*") -> EngineStandIn:
        self._context = zmq.asyncio.Context()
        self.publisher = KVEventPublisher(
            self._context,
            events_endpoint,
            "tcp://127.0.0.1:*" if replay else None,
            topic="kv",
        ).start()
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    async def _health(self, _: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def _metrics(self, _: web.Request) -> web.Response:
        running, waiting, usage = self.load
        labels = f'engine="0",model_name="{self.model}"'
        text = (
            f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{{labels}}} {running}\n"
            f"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{{labels}}} {waiting}\n"
            f"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{{{labels}}} {usage}\n"
            f"# TYPE vllm:cache_config_info gauge\n"
            f'vllm:cache_config_info{{block_size="{self.block_size}",engine="0"{self._capacity_label}}} 1.0\n'
        )
        return web.Response(text=text, content_type="text/plain")

    @property
    def _capacity_label(self) -> str:
        return "" if self.num_gpu_blocks is None else f',num_gpu_blocks="{self.num_gpu_blocks}"'

    async def _models(self, _: web.Request) -> web.Response:
        base = {"id": self.model, "object": "model", "root": f"/models/{self.model}", "parent": None}
        loras = [{"id": a, "object": "model", "root": f"/adapters/{a}", "parent": self.model} for a in self.adapters]
        return web.json_response({"object": "list", "data": [base, *loras]})

    async def stop(self) -> None:
        if self.publisher is not None:
            await self.publisher.close()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._context is not None:
            self._context.destroy(linger=0)


@dataclass
class AgentProcess:
    args: list[str]
    metrics_port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    def start(self) -> AgentProcess:
        handle, name = tempfile.mkstemp(prefix="kvroute-agent-", suffix=".log")
        os.close(handle)
        self.log_path = Path(name)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "worker_agent",
                    *self.args,
                    "--metrics-port",
                    str(self.metrics_port),
                    "--metrics-host",
                    "127.0.0.1",
                    "--log-level",
                    "DEBUG",
                ],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        return self

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path else ""

    async def metrics(self) -> dict[str, float]:
        """The agent's counters and gauges by sample name (labels folded in as name{k=v})."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        async with aiohttp.ClientSession() as session:
            return (await read_metrics(session, url)).flat()

    async def health(self) -> tuple[int, dict[str, object]]:
        url = f"http://127.0.0.1:{self.metrics_port}/health"
        async with aiohttp.ClientSession() as session, session.get(url) as response:
            return response.status, await response.json()

    async def metric(self, name: str) -> float:
        try:
            return (await self.metrics()).get(name, 0.0)
        except aiohttp.ClientError:
            return -1.0

    def terminate(self, timeout: float = 10.0) -> int:
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@dataclass
class SimFleet:
    """N simulated engines (in this process: real HTTP and ZMQ) with an agent process each."""

    redis_url: str
    count: int = 3
    model: str = "tiny"
    block_size: int = 16
    num_blocks: int = 256
    speedup: float = 20.0
    max_running: int = 64
    agent_args: list[str] = field(default_factory=list)  # more flags for every agent
    engine_metrics: str = "full"  # the engines' --metrics: full, or minimal (three gauges)
    adapters: Sequence[Sequence[str]] = ()  # engine i serves the LoRA adapters adapters[i]
    cpu_blocks: int = 0  # a CPU tier behind each engine's GPU cache (sim_engine/offload.py)
    disk_blocks: int = 0  # a disk tier behind it (or right behind the GPU without a CPU tier)
    sliding_window: int = 0  # a hybrid model's sliding-window group beside full attention (sim_engine/hybrid.py)
    max_model_len: int = 4096
    # Engine i's part in a prefill/decode split: "prefill", "decode" or "both" (its agent's --role);
    # given, every engine runs with --kv-transfer (sim_engine/kv_transfer.py). Empty: no split.
    roles: Sequence[str] = ()
    # Engine i imitates engine_kinds[i] ("vllm" or "sglang": its KV-event wire, metric names and
    # owned_by, which its agent reads to tell); empty: vLLM for all.
    engine_kinds: Sequence[str] = ()
    # Engine i's block (page) size, where it is not block_size (an SGLang engine's --page-size)
    block_sizes: Sequence[int] = ()
    engines: list = field(default_factory=list)
    agents: list[AgentProcess] = field(default_factory=list)
    _contexts: list = field(default_factory=list)

    async def start(self) -> SimFleet:
        from sim_engine.engine import TimingModel
        from sim_engine.server import running_engine
        from sim_engine.settings import SimEngineSettings

        if self.roles and len(self.roles) != self.count:
            raise ValueError(f"roles names {len(self.roles)} engines' parts, the fleet has {self.count} engines")
        for number in range(self.count):
            served = self.adapters[number] if number < len(self.adapters) else ()
            settings = SimEngineSettings(
                port=0,
                events_endpoint="tcp://127.0.0.1:*",
                replay_endpoint="tcp://127.0.0.1:*",
                topic="kv",
                model=self.model,
                num_blocks=self.num_blocks,
                block_size=self.block_sizes[number] if number < len(self.block_sizes) else self.block_size,
                engine_kind=self.engine_kinds[number] if number < len(self.engine_kinds) else "vllm",
                timing=TimingModel(speedup=self.speedup, max_running=self.max_running),
                metrics=self.engine_metrics,
                lora_modules=tuple((name, f"/adapters/{name}") for name in served),
                enable_lora=True,
                cpu_blocks=self.cpu_blocks,
                disk_blocks=self.disk_blocks,
                sliding_window=self.sliding_window,
                max_model_len=self.max_model_len,
                kv_transfer=bool(self.roles),
            )
            context = running_engine(settings)
            self.engines.append(await context.__aenter__())
            self._contexts.append(context)
        for engine in self.engines:
            self.agents.append(self.agent_for(engine).start())
        return self

    def agent_for(self, engine) -> AgentProcess:
        if engine.publisher is not None and engine.events_endpoint is None:  # TensorRT-LLM's: polled over HTTP
            events = ["--engine-kind", "trtllm"]
        else:
            events = ["--events", engine.events_endpoint, "--replay", engine.replay_endpoint, "--topic", "kv"]
        return AgentProcess(
            [
                "--engine-url",
                engine.url,
                *events,
                "--redis-url",
                self.redis_url,
                "--ttl-ms",
                "3000",
                *self.role_args(engine),
                *self.agent_args,
            ]
        )

    def role_args(self, engine) -> list[str]:
        """The agent's --role for ``engine`` (none when the fleet has no roles)."""
        if not self.roles:
            return []
        return ["--role", self.roles[self.engines.index(engine)]]

    def worker_id(self, index: int) -> str:
        return f"{self.engines[index].url}#0"

    def agents_report(self, lines: int = 4) -> str:
        """Each agent's state and last log lines: why a worker is not registered, when one is not."""
        reports = []
        for agent in self.agents:
            code = agent.process.poll() if agent.process is not None else "never started"
            tail = " | ".join(agent.log().splitlines()[-lines:])
            reports.append(f"agent on :{agent.metrics_port} ({'running' if code is None else f'exit {code}'}): {tail}")
        return "\n".join(reports)

    def engine_of(self, worker_id: str):
        return next(e for e in self.engines if f"{e.url}#0" == worker_id)

    async def kill_engine(self, index: int) -> None:
        """Stop engine ``index`` at once (HTTP, KV events and replay gone); its agent keeps running."""
        context, self._contexts[index] = self._contexts[index], None
        if context is not None:
            await context.__aexit__(None, None, None)

    async def stop(self) -> None:
        for agent in self.agents:
            agent.kill()
        for context in reversed(self._contexts):
            if context is not None:
                await context.__aexit__(None, None, None)


async def prefill_leg(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], path: str = "/v1/completions"
) -> dict[str, Any]:
    """Send ``body``'s prefill leg to the engine at ``url`` by hand, as the router sends it
    (router/upstream/split.py, after vLLM's disaggregated-serving proxies): its JSON reply (whose
    ``kv_transfer_params`` the decode leg carries)."""
    headers = {"Content-Type": "application/json"}
    async with session.post(url + path, data=prefill_body(body), headers=headers) as response:
        reply = await response.json()
        assert response.status == 200 and isinstance(reply.get("kv_transfer_params"), dict), reply
        return reply


def decode_leg(body: dict[str, Any], prefilled: dict[str, Any]) -> dict[str, Any]:
    """The decode leg of ``body``: the client's body with the prefill reply's ``kv_transfer_params``."""
    return {**body, "kv_transfer_params": prefilled["kv_transfer_params"]}


def raw_call(name: str, keys: Sequence[Any], args: Sequence[Any] = ()) -> ScriptCall[Any]:
    """A call of script ``name`` as given, unchecked by its declaration (kvindex.calls): for
    tests that send what no caller would (malformed arguments, keys of their own)."""
    return ScriptCall(SPECS[name], keys, args)
