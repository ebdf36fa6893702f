"""Fixtures of the agent's end-to-end tests: one of the session's Redis servers, an index client on
it, and an engine stand-in (the engine's HTTP side and KV-event publisher, in this process) that can
be told to misbehave: a /metrics page of its choosing, a /health that hangs, a process start time.
:class:`RedisProxy` puts a TCP hop between an agent and Redis that can change what Redis says;
:class:`ReplayGate` one between an agent and the engine's replay socket that can stall an answer."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
import zmq
import zmq.asyncio
from aiohttp import web
from redis.asyncio import Redis

from kvindex.redis_index import RedisIndex
from kvroute.devstack.embedded_redis import RedisServer
from tests.conftest import server_kinds
from tests.support import AgentProcess, EngineStandIn
from tests.support.agent import BS, agent_args


@dataclass
class FaultyEngine(EngineStandIn):
    """The stand-in with knobs: ``metrics_page`` replaces the load gauges of /metrics (the block size
    line stays), ``start_time`` and ``prompt_tokens`` add ``process_start_time_seconds`` and
    ``vllm:prompt_tokens_total`` (a real vLLM has both: the agent's restart evidence), and
    :meth:`hang_health` makes /health answer only once :meth:`answer_health` is called."""

    metrics_page: str | None = None
    start_time: float | None = None
    prompt_tokens: float | None = None
    health_requests: int = 0
    _answering: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self._answering.set()

    def hang_health(self) -> None:
        self._answering.clear()

    def answer_health(self) -> None:
        self._answering.set()

    async def _health(self, request: web.Request) -> web.Response:
        self.health_requests += 1
        await self._answering.wait()
        return await super()._health(request)

    async def _metrics(self, request: web.Request) -> web.Response:
        text = (await super()._metrics(request)).text or ""
        if self.metrics_page is not None:
            text = self.metrics_page + "".join(line + "\n" for line in text.splitlines() if "cache_config" in line)
        if self.start_time is not None:
            text += f"# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds {self.start_time!r}\n"
        if self.prompt_tokens is not None:
            counter = "vllm:prompt_tokens_total"
            text += f'# TYPE {counter} counter\n{counter}{{engine="0"}} {self.prompt_tokens!r}\n'
        return web.Response(text=text, content_type="text/plain")


@pytest.fixture
def server(redis_servers: dict[str, RedisServer]) -> RedisServer:
    return redis_servers[server_kinds()[0]]


@pytest.fixture
async def index(server: RedisServer) -> AsyncIterator[RedisIndex]:
    client = Redis.from_url(server.url)
    yield RedisIndex(client)
    await client.aclose()


@pytest.fixture
async def engine(unique_name: str) -> AsyncIterator[FaultyEngine]:
    stand_in = await FaultyEngine(model=unique_name, block_size=BS).start()
    yield stand_in
    await stand_in.stop()


class RedisProxy:
    """A TCP proxy (in this process) to a Redis server on ``upstream_port``. ``hide_run_id`` renames
    the ``run_id`` field of INFO replies, as some proxies and managed services leave it out: the bytes
    keep their length, so the RESP framing stays valid. :meth:`pause` holds every command until
    :meth:`resume` (a Redis that stopped answering)."""

    def __init__(self, upstream_port: int, hide_run_id: bool = False) -> None:
        self.upstream_port = upstream_port
        self.hide_run_id = hide_run_id
        self.port = 0
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> RedisProxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def pause(self) -> None:
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    async def stop(self) -> None:
        self.resume()
        if self._server is not None:
            self._server.close()
        for writer in self._writers:
            writer.close()  # the pipes end and their tasks return
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:  # Redis is down: so is the proxy's connection
            client_writer.close()
            self._tasks.discard(task)
            return
        self._writers |= {client_writer, upstream_writer}
        try:
            await asyncio.gather(
                self._pipe(client_reader, upstream_writer, False, self._flowing),
                self._pipe(upstream_reader, client_writer, self.hide_run_id),
                return_exceptions=True,
            )
        finally:
            client_writer.close()
            upstream_writer.close()
            self._writers -= {client_writer, upstream_writer}
            self._tasks.discard(task)

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, hide: bool, gate: asyncio.Event | None = None
    ) -> None:
        held = b""  # a chunk's tail that may be the start of "run_id:" (a RESP reply ends in \r\n)
        try:
            while chunk := await reader.read(65536):
                if gate is not None:
                    await gate.wait()
                data = held + chunk
                held = b""
                if hide:
                    data = data.replace(b"run_id:", b"run_xx:")
                    cut = next((n for n in range(6, 0, -1) if data.endswith(b"run_id:"[:n])), 0)
                    data, held = (data[:-cut], data[-cut:]) if cut else (data, b"")
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()


class ReplayGate:
    """A ROUTER in front of the engine's replay socket. While ``stall`` is set, it relays the engine's
    answer without its end marker and then sends the last batch again every ``drip_s`` seconds: the
    answer neither ends nor goes idle (an engine stuck in a slow send), until ``stall`` is cleared."""

    def __init__(self, upstream: str, drip_s: float = 0.3) -> None:
        self.upstream = upstream
        self.drip_s = drip_s
        self.stall = False
        self.requests = 0
        self._context = zmq.asyncio.Context()
        self._router = self._context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.bind("tcp://127.0.0.1:*")
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def endpoint(self) -> str:
        return self._router.getsockopt(zmq.LAST_ENDPOINT).decode()  # type: ignore[union-attr]

    def start(self) -> ReplayGate:
        self._tasks.add(asyncio.create_task(self._serve()))
        return self

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._context.destroy(linger=0)

    async def _serve(self) -> None:
        while True:
            client, _, start = await self._router.recv_multipart()
            self.requests += 1
            answer = await self._fetch(start)
            if not self.stall:
                for frames in answer:
                    await self._router.send_multipart([client, *frames])
            else:  # everything but the end marker, then the drip
                self._tasks.add(asyncio.create_task(self._drip(client, answer[:-1])))

    async def _fetch(self, start: bytes) -> list[list[bytes]]:
        """The engine's whole answer, end marker last."""
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.upstream)
        answer: list[list[bytes]] = []
        try:
            await dealer.send_multipart([b"", start])
            while not answer or answer[-1][2] != b"\xff" * 8:
                answer.append(await asyncio.wait_for(dealer.recv_multipart(), 10))
        finally:
            dealer.close(linger=0)
        return answer

    async def _drip(self, client: bytes, batches: list[list[bytes]]) -> None:
        for frames in batches:
            await self._router.send_multipart([client, *frames])
        while self.stall and batches:
            await asyncio.sleep(self.drip_s)  # the fault itself: a trickle, not a synchronisation
            await self._router.send_multipart([client, *batches[-1]])


@pytest.fixture
async def gate(engine: FaultyEngine) -> AsyncIterator[ReplayGate]:
    assert engine.publisher is not None and engine.publisher.replay_endpoint is not None
    replay_gate = ReplayGate(engine.publisher.replay_endpoint).start()
    yield replay_gate
    await replay_gate.stop()


def gated_agent(engine: EngineStandIn, redis_url: str, gate: ReplayGate, *extra: str) -> AgentProcess:
    """An agent whose replay requests go through ``gate``."""
    args = agent_args(engine, redis_url)
    args[args.index("--replay") + 1] = gate.endpoint
    return AgentProcess([*args, *extra]).start()


def start_agent(engine: EngineStandIn, redis_url: str, *extra: str, replay: bool = True) -> AgentProcess:
    """An agent process following ``engine`` (its replay socket unless told otherwise)."""
    return AgentProcess([*agent_args(engine, redis_url, replay=replay), *extra]).start()


def stop_agent(process: AgentProcess) -> None:
    """Kill it; print its log when it had exited by itself with an error (the test's evidence)."""
    crashed = process.process is not None and process.process.poll() not in (None, 0)
    process.kill()
    if crashed:
        print(process.log())
