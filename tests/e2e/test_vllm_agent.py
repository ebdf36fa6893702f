"""The agent against a REAL vLLM server (CPU build, the shared tiny model): `pytest -m vllm`.

An independent observer subscribes to the same event stream and keeps vLLM's cache as vLLM
announced it, keyed by token content (never by anyone's hash). After each step the index must
agree with it exactly, for every prompt sent: the blocks vLLM holds are the blocks the index
lists, no more, no fewer. The server runs with a 12-block cache so that evictions happen.
See docs/sim-engine.md ("Against a real vLLM"); `.ci/vllm-env` builds the vLLM environment.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

import aiohttp
import pytest
import zmq
from redis.asyncio import Redis
from zmq.utils.monitor import recv_monitor_message

from kvevents.vllm import AllBlocksCleared, BlockRemoved, BlockStored, decode_message
from kvindex.hashing import sequence_hashes
from kvindex.redis_index import RedisIndex
from kvroute.devstack.embedded_redis import RedisServer
from tests.conftest import server_kinds
from tests.support import ROOT, AgentProcess, wait_until
from tests.support.vllm import BS, MODEL, VllmServer, vllm_server

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def vllm() -> Iterator[VllmServer]:
    with vllm_server(num_blocks=12) as server:
        yield server


@dataclass
class Observer:
    """vLLM's cache as its events describe it, keyed by (salt, token prefix)."""

    socket: zmq.Socket
    prefix_of: dict[int, tuple] = field(default_factory=dict)
    copies: dict[int, int] = field(default_factory=dict)
    seqs: list[int] = field(default_factory=list)
    removals: int = 0

    def drain(self) -> None:
        while True:
            try:
                frames = self.socket.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            batch = decode_message(frames)
            self.seqs.append(batch.seq)
            for event in batch.events:
                self._apply(event)

    def _apply(self, event: object) -> None:
        if isinstance(event, AllBlocksCleared):
            self.prefix_of.clear()
            self.copies.clear()
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                self.removals += 1
                self.copies[h] -= 1
                if not self.copies[h]:
                    del self.copies[h], self.prefix_of[h]
        elif isinstance(event, BlockStored):
            if event.parent_block_hash is None:
                salt = event.extra_keys[0][0] if event.extra_keys and event.extra_keys[0] else None
                prefix: tuple = (salt,)
            else:
                prefix = self.prefix_of[event.parent_block_hash]
            for i, h in enumerate(event.block_hashes):
                prefix = (*prefix, *event.token_ids[i * BS : (i + 1) * BS])
                self.prefix_of.setdefault(h, prefix)
                self.copies[h] = self.copies.get(h, 0) + 1

    def held_blocks(self, tokens: list[int], salt: str | None = None) -> int:
        held = set(self.prefix_of.values())
        n = 0
        while (n + 1) * BS <= len(tokens) and (salt, *tokens[: (n + 1) * BS]) in held:
            n += 1
        return n

    def servable_blocks(self) -> int:
        """Held blocks whose whole prefix is held: what the index should list."""
        held = set(self.prefix_of.values())
        return sum(all((p[0], *p[1 : 1 + k * BS]) in held for k in range(1, (len(p) - 1) // BS)) for p in held)


@pytest.fixture(scope="module")
def observer(vllm: VllmServer) -> Iterator[Observer]:
    context = zmq.Context()
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, b"kv")
    handshakes = socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    socket.connect(f"tcp://127.0.0.1:{vllm.events_port}")
    # The subscription goes out with the handshake; it must reach the PUB before the first request.
    assert handshakes.poll(10_000), "no ZMQ handshake with vLLM's publisher within 10 s"
    assert recv_monitor_message(handshakes)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
    socket.disable_monitor()
    handshakes.close(linger=0)
    yield Observer(socket)
    socket.close(linger=0)
    context.term()


@pytest.fixture(scope="module")
def redis(redis_servers: dict[str, RedisServer]) -> RedisServer:
    return redis_servers[server_kinds()[0]]


def agent_args(server: VllmServer, redis: RedisServer) -> list[str]:
    events, replay = f"tcp://127.0.0.1:{server.events_port}", f"tcp://127.0.0.1:{server.replay_port}"
    args = f"--engine-url {server.url}/v1 --events {events} --replay {replay} --topic kv --prefix vllmtest"
    return [*args.split(), "--redis-url", redis.url]


@pytest.fixture(scope="module")
def agents(vllm: VllmServer, redis: RedisServer, observer: Observer) -> Iterator[list[AgentProcess]]:
    running = [AgentProcess(agent_args(vllm, redis)).start()]
    yield running
    for agent in running:
        agent.kill()


SENT: list[tuple[list[int], str | None]] = []  # every prompt sent, for the convergence checks


async def complete(server: VllmServer, tokens: list[int], salt: str | None = None) -> dict:
    body: dict = {"model": MODEL, "prompt": tokens, "max_tokens": 1}
    if salt:
        body["cache_salt"] = salt
    SENT.append((tokens, salt))
    async with aiohttp.ClientSession() as session, session.post(f"{server.url}/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def converged(index: RedisIndex, observer: Observer, worker_id: str) -> None:
    mismatches: list[str] = []

    async def agrees() -> bool:
        observer.drain()
        mismatches.clear()
        for tokens, salt in SENT:
            chain = sequence_hashes(tokens, BS, cache_salt=salt)
            got, held = (await index.match(MODEL, chain)).get(worker_id, -1), observer.held_blocks(tokens, salt)
            if got != held:
                mismatches.append(f"{len(tokens)} tokens salt {salt}: index {got}, vLLM {held}")
        records = [r for r in await index.workers(MODEL) if r.worker_id == worker_id]
        entries, servable = records[0].blocks if records else None, observer.servable_blocks()
        if entries != servable:
            mismatches.append(f"entries: index {entries}, vLLM {servable}")
        return not mismatches

    try:
        await wait_until(agrees, 10)
    except AssertionError:
        raise AssertionError("index and vLLM disagree: " + "; ".join(mismatches)) from None
    assert observer.seqs == list(range(len(observer.seqs))), "the observer itself missed batches"


@pytest.fixture
async def index(redis: RedisServer) -> Iterator[RedisIndex]:
    from kvindex.keys import KeySchema

    client = Redis.from_url(redis.url)
    yield RedisIndex(client, KeySchema("vllmtest"))
    await client.aclose()


def worker_id(server: VllmServer) -> str:
    return f"{server.url}#0"


async def test_shared_prefix_prompts_are_indexed_exactly(vllm, observer, agents, index):
    base = [(i * 7) % 1900 + 10 for i in range(96)]  # 3 blocks
    await complete(vllm, [*base, 5, 6, 7])
    await complete(vllm, base[:64] + list(range(500, 540)))  # shares 2 blocks
    await complete(vllm, [*base, 5, 6, 7], salt="tenant-a")  # same tokens, another cache
    await converged(index, observer, worker_id(vllm))
    assert observer.held_blocks(base, "tenant-a") == 3 and observer.held_blocks(base) == 3

    redis_url = agents[0].args[-1]  # agent_args ends with the --redis-url
    lookup_args = ["index", "lookup", "--redis-url", redis_url, "--prefix", "vllmtest", "--model", MODEL, "--json"]
    lookup = subprocess.run(  # noqa: ASYNC221 - a short CLI call; nothing else runs meanwhile
        [sys.executable, "-m", "kvroute", *lookup_args, "--tokens", json.dumps([*base, 5, 6, 7])],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    workers = {w["id"]: w["matched_blocks"] for w in json.loads(lookup.stdout)["workers"]}
    assert workers == {worker_id(vllm): 3}

    # vLLM's own report agrees with what the index predicts (whole blocks, capped at len - 1).
    again = await complete(vllm, [*base, 5, 6, 7])
    predicted = min(3 * BS, (len(base) + 3 - 1) // BS * BS)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == predicted


async def test_chat_prompts_are_indexed_with_their_template(vllm, observer, agents, index):
    messages = [{"role": "system", "content": "You are a tiny test model. " * 6}, {"role": "user", "content": "Hi!"}]
    async with aiohttp.ClientSession() as session:
        body = {"model": MODEL, "messages": messages, "add_generation_prompt": True}
        async with session.post(f"{vllm.url}/tokenize", json=body) as r:
            tokens = (await r.json())["tokens"]
        async with session.post(
            f"{vllm.url}/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 1}
        ) as r:
            assert r.status == 200
    SENT.append((tokens, None))
    await converged(index, observer, worker_id(vllm))
    assert observer.held_blocks(tokens) >= 1


async def test_evictions_in_a_tiny_cache_are_removed_from_the_index(vllm, observer, agents, index):
    removals_before = observer.removals
    for n in range(6):  # 6 prompts x 3 blocks > 12 blocks: vLLM must evict
        await complete(vllm, [(n * 131 + i * 11) % 1900 + 20 for i in range(100)])
    await converged(index, observer, worker_id(vllm))
    assert observer.removals > removals_before


async def test_an_agent_killed_mid_stream_converges_after_restart(vllm, observer, agents, index, redis):
    agents[0].kill()
    for n in range(3):
        await complete(vllm, [(n * 17 + i * 5) % 1900 + 30 for i in range(70)])
    agents.append(AgentProcess(agent_args(vllm, redis)).start())
    await converged(index, observer, worker_id(vllm))
    await complete(vllm, [(i * 3) % 1900 + 40 for i in range(80)])
    await converged(index, observer, worker_id(vllm))
    assert agents[-1].terminate() == 0
    assert await index.match(MODEL, sequence_hashes(SENT[-1][0], BS)) == {}
