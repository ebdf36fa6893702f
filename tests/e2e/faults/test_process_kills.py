"""Processes killed with SIGKILL: a router replica (the other keeps serving, the shared load
forgets the dead one's bookings), an agent (restarted: it rebuilds its worker from the engine's
replay buffer) and an engine (its worker leaves the index; requests go elsewhere)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import aiohttp
import pytest
from redis.exceptions import RedisError

from kvindex.keys import KeySchema
from kvindex.redis_index import RedisIndex
from kvindex.replies import decode, time_ms
from kvroute.devstack.embedded_redis import free_port
from tests.e2e.faults.measure import MODEL, Scene, open_scene
from tests.support import ROOT, wait_until

pytestmark = pytest.mark.faults


async def alive(scene: Scene, index: int) -> bool:
    try:
        workers = await RedisIndex(scene.client).workers(MODEL)
    except (RedisError, OSError):
        return False
    return any(w.worker_id == scene.worker(index) and w.alive for w in workers)


async def start_replica(redis_url: str, replica_id: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    command = [sys.executable, "-m", "router", "--redis-url", redis_url, "--port", str(port)]
    process = subprocess.Popen([*command, "--replica-id", replica_id], cwd=ROOT)  # noqa: ASYNC220
    url = f"http://127.0.0.1:{port}"

    async def ready() -> bool:
        try:
            async with aiohttp.ClientSession() as session, session.get(url + "/ready") as response:
                return response.status == 200
        except aiohttp.ClientError:
            return False

    await wait_until(ready, 30)
    return process, url


async def lease_counts(scene: Scene, replica_id: str) -> bool:
    """Whether ``replica_id``'s lease (and so its booked load) still counts in the shared load."""
    keys = KeySchema().for_model(MODEL)
    deadline = await scene.client.zscore(keys.replicas, replica_id)
    return deadline is not None and deadline > time_ms(await scene.client.time())


async def test_a_router_replica_killed(redis_server):
    async with open_scene(redis_server) as scene:
        doomed, url = await start_replica(redis_server.url, "doomed")
        session = aiohttp.ClientSession()
        try:
            scene.extra_router_urls.append(url)
            await scene.prime()
            body = {"model": MODEL, "prompt": scene.probes[0], "max_tokens": 2000, "stream": True}
            streams = [await session.post(url + "/v1/completions", json=body) for _ in range(3)]
            booked = KeySchema().for_model(MODEL).inflight("doomed")

            async def doomed_booked() -> bool:  # on whichever workers its decisions chose
                fields = await scene.client.hgetall(booked)
                return sum(int(n) for field, n in fields.items() if decode(field).startswith("r:")) == 3

            await wait_until(doomed_booked, 10)
            doomed.kill()
            since = time.monotonic()
            scene.extra_router_urls.remove(url)

            async def load_forgotten() -> float:
                await wait_until(lambda: _not(lease_counts(scene, "doomed")), 10)
                return time.monotonic() - since

            recovery, load_s = await asyncio.gather(scene.recover(since), load_forgotten())
            for stream in streams:
                stream.close()
        finally:
            doomed.kill()
            doomed.wait()
            await session.close()
        figures = scene.figures("router_replica_kill9", [recovery], shared_load_forgotten_s=round(load_s, 2))
        scene.check(figures, [recovery])


async def _not(check) -> bool:
    return not await check


@pytest.mark.parametrize("kinds", [(), ("sglang", "vllm", "sglang")], ids=["vllm", "sglang_first"])
async def test_an_agent_killed_and_restarted(redis_server, kinds):
    """The restarted agent rebuilds its worker from the engine's replay buffer (vLLM's, SGLang's)."""
    async with open_scene(redis_server, engine_kinds=kinds) as scene:
        await scene.prime()
        scene.fleet.agents[0].kill()
        await wait_until(lambda: _not(alive(scene, 0)), 15)  # its heartbeat TTL runs out
        await scene.traffic.progressed(10)  # served by the others meanwhile
        scene.fleet.agents[0] = scene.fleet.agent_for(scene.fleet.engines[0]).start()
        since = time.monotonic()
        recovery = await scene.recover(since)
        figures = scene.figures("agent_kill9_restart" + ("_sglang" if kinds else ""), [recovery])
        scene.check(figures, [recovery])


async def test_an_engine_killed(redis_server):
    async with open_scene(redis_server) as scene:
        await scene.prime()
        scene.dead.add(2)
        await scene.fleet.kill_engine(2)
        since = time.monotonic()
        recovery = await scene.recover(since)
        assert not await alive(scene, 2)
        figures = scene.figures("engine_kill", [recovery])
        scene.check(figures, [recovery])
