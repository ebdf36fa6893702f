"""``kvroute bench agent``: how many block events per second one agent process applies.

A publisher in this process plays a busy engine whose cache is full: every batch stores a run
of new blocks (a request's prefill chunk, continuing a conversation's chain) and evicts as many
old ones, tail first, as vLLM does. All batches are encoded before the clock starts, so the
publisher is not what is measured. The agent is a real ``python -m worker_agent`` process with
a real Redis; the run ends when the agent reports the last batch applied.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass

import aiohttp
import zmq
import zmq.asyncio
from aiohttp import web

from kvroute.embedded_redis import free_port, redis_url_or_private
from kvroute.stack import metric_value
from sim_engine.kv_events import encode_batch, removed_event, stored_event

MODEL = "bench-agent"


@dataclass
class Workload:
    frames: list[list[bytes]]
    block_events: int


def build_workload(batches: int, blocks_per_batch: int, cache_blocks: int, block_size: int, seed: int = 3) -> Workload:
    rng = random.Random(seed)
    chains: deque[list[int]] = deque()
    held = 0
    next_hash = 1
    frames: list[list[bytes]] = []
    events_total = 0
    for seq in range(batches):
        events = []
        while held + blocks_per_batch > cache_blocks:  # evict the oldest chain, tail first
            victim = chains[0].pop()
            held -= 1
            events.append(removed_event([victim]))
            if not chains[0]:
                chains.popleft()
        if not chains or len(chains[-1]) >= 64 or rng.random() < 0.2:
            chains.append([])
        chain = chains[-1]
        hashes = list(range(next_hash, next_hash + blocks_per_batch))
        next_hash += blocks_per_batch
        tokens = [rng.randrange(32000) for _ in range(blocks_per_batch * block_size)]
        events.append(stored_event(hashes, chain[-1] if chain else None, tokens, block_size))
        chain.extend(hashes)
        held += blocks_per_batch
        events_total += len(events) - 1 + blocks_per_batch
        frames.append([b"kv", seq.to_bytes(8, "big"), encode_batch(events)])
    return Workload(frames, events_total)


async def _health_server(port: int) -> web.AppRunner:
    async def ok(_: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.router.add_get("/health", ok)
    app.router.add_get("/metrics", ok)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


async def _agent_metric(session: aiohttp.ClientSession, port: int, name: str) -> float | None:
    try:
        return await metric_value(session, f"http://127.0.0.1:{port}", name)
    except aiohttp.ClientError:
        return None


async def _wait_metric(session: aiohttp.ClientSession, port: int, name: str, value: float, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if await _agent_metric(session, port, name) == value:
            return True
        await asyncio.sleep(0.02)
    return False


async def run_benchmark(redis_url: str, args: argparse.Namespace) -> dict[str, float]:
    workload = build_workload(args.batches, args.blocks_per_batch, args.cache_blocks, args.block_size)
    http_port, metrics_port = free_port(), free_port()
    runner = await _health_server(http_port)
    context = zmq.asyncio.Context()
    pub = context.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    command = [sys.executable, "-m", "worker_agent", "--engine-url", f"http://127.0.0.1:{http_port}",
               "--events", f"tcp://127.0.0.1:{port}", "--topic", "kv", "--model", MODEL,
               "--block-size", str(args.block_size), "--redis-url", redis_url, "--metrics-port", str(metrics_port),
               "--metrics-host", "127.0.0.1", "--log-level", "WARNING"]  # fmt: skip
    agent = subprocess.Popen(command)  # noqa: ASYNC220 - starting it does not block
    try:
        async with aiohttp.ClientSession() as session:
            if not await _wait_metric(session, metrics_port, "kvroute_agent_registered", 1.0, 30):
                raise RuntimeError("the agent did not register within 30 s")
            await asyncio.sleep(0.5)  # let the subscription reach the publisher
            started = time.perf_counter()
            for frames in workload.frames:
                await pub.send_multipart(frames)
            sent = time.perf_counter() - started
            last = float(len(workload.frames) - 1)
            if not await _wait_metric(session, metrics_port, "kvroute_agent_last_seq", last, 600):
                raise RuntimeError("the agent did not apply every batch")
            elapsed = time.perf_counter() - started
            gaps = await _agent_metric(session, metrics_port, "kvroute_agent_gaps_total")
            indexed = await _agent_metric(session, metrics_port, "kvroute_agent_mirror_indexed_blocks")
    finally:
        agent.terminate()
        agent.wait(30)
        pub.close(linger=0)
        context.destroy(linger=0)
        await runner.cleanup()
    return {
        "batches": len(workload.frames),
        "block_events": workload.block_events,
        "publish_s": round(sent, 3),
        "elapsed_s": round(elapsed, 3),
        "block_events_per_s": round(workload.block_events / elapsed),
        "batches_per_s": round(len(workload.frames) / elapsed),
        "gaps": gaps or 0.0,
        "indexed_blocks_at_end": indexed or 0.0,
    }


def run_from_args(args: argparse.Namespace) -> int:
    with redis_url_or_private(args.redis_url) as url:
        results = asyncio.run(run_benchmark(url, args))
    width = max(len(k) for k in results)
    for key, value in results.items():
        print(f"{key.ljust(width)}  {value}")
    return 0
