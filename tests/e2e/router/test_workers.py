"""``kvroute router --workers 2``: two processes on one port, each a replica of its own, both
serving, the shared load booked by each and released by each; the set stops as one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
from redis.asyncio import Redis

from kvindex.keys import KeySchema
from kvroute.devstack.embedded_redis import free_port
from tests.support import ROOT, wait_until
from tests.support.router import PREFIX

REPLICAS = ("multi-w0", "multi-w1")


def _start(redis_url: str, port: int) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "router", "--redis-url", redis_url, "--port", str(port)]
    command += ["--workers", "2", "--replica-id", "multi", "--log-level", "WARNING"]
    return subprocess.Popen(command, cwd=ROOT)


def _children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _gone(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists()


async def _requests_booked(client: Redis) -> dict[str, int]:
    """Requests each replica has booked in Redis now (its own inflight hash)."""
    model = KeySchema().for_model("tiny")
    booked = {}
    for replica in REPLICAS:
        fields = await client.hgetall(model.inflight(replica))
        booked[replica] = sum(int(v) for k, v in fields.items() if k.startswith(b"r:"))
    return booked


async def test_two_processes_serve_one_port_and_each_books_its_own_load(fleet, redis_server):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    parent = _start(redis_server.url, port)
    client = Redis.from_url(redis_server.url)
    streams: list[tuple[aiohttp.ClientSession, aiohttp.ClientResponse]] = []
    try:
        seen: set[str] = set()

        async def both_answer() -> bool:  # each session's connection is new: the kernel spreads them
            try:  # ready (it knows the worker) and which replica, asked on one kept-alive connection
                async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
                    async with session.get(url + "/ready") as ready:
                        knows_workers = ready.status == 200
                    async with session.get(url + "/health") as response:
                        replica = (await response.json())["replica"]
                if knows_workers:
                    seen.add(replica)
            except aiohttp.ClientError:
                pass
            return seen == set(REPLICAS)

        await wait_until(both_answer, 30, interval=0.05)
        assert len(_children(parent.pid)) == 2

        async def open_stream() -> None:
            session = aiohttp.ClientSession()
            body = {"model": "tiny", "prompt": [*PREFIX, len(streams)], "max_tokens": 2000, "stream": True}
            streams.append((session, await session.post(url + "/v1/completions", json=body)))
            assert streams[-1][1].status == 200

        async def both_hold_streams() -> bool:  # each stream on a new connection, until both have some
            await open_stream()

            async def settled() -> bool:
                return sum((await _requests_booked(client)).values()) == len(streams)

            await wait_until(settled, 10)
            return all(n > 0 for n in (await _requests_booked(client)).values())

        await wait_until(both_hold_streams, 30, interval=0)
        # Each process's share is its own, and the load every decision reads is their sum.
        booked = await _requests_booked(client)
        assert sum(booked.values()) == len(streams) and all(booked.values()), booked
        for session, response in streams:
            response.close()
            await session.close()
        streams.clear()

        async def released() -> bool:
            return sum((await _requests_booked(client)).values()) == 0

        await wait_until(released, 10)
        children = _children(parent.pid)
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(30) == 0
        for child in children:  # reaped by the parent: gone
            assert _gone(child)
    finally:
        for session, response in streams:
            response.close()
            await session.close()
        parent.kill()
        await client.aclose()


async def test_one_process_ending_stops_the_set(redis_server):
    port = free_port()
    parent = _start(redis_server.url, port)
    try:

        async def both_started() -> bool:
            return len(_children(parent.pid)) == 2

        await wait_until(both_started, 30)
        survivor, victim = _children(parent.pid)
        os.kill(victim, signal.SIGKILL)
        assert parent.wait(30) == 1  # the service manager restarts the set
        assert _gone(survivor)
    finally:
        parent.kill()


def test_a_set_needs_a_fixed_port():
    command = [sys.executable, "-m", "router", "--port", "0", "--workers", "2"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--workers above 1 needs a fixed --port" in done.stderr
    assert "Traceback" not in done.stderr
