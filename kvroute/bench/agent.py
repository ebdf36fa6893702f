"""``kvroute bench agent``: how many block events per second one agent process applies.

A publisher in this process plays a busy engine whose cache is full: every batch stores a run
of new blocks (a request's prefill chunk, continuing a conversation's chain) and evicts as many
old ones, tail first, as vLLM does. With ``--sglang-page-size`` it plays SGLang: the same blocks
as pages of that many tokens on SGLang's wire, which the agent re-blocks. All batches are encoded
before the clock starts, so the publisher is not what is measured. The agent is a real
``python -m worker_agent`` process with a real Redis; the run ends when the agent reports the last
batch applied.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections import deque
from dataclasses import dataclass

import aiohttp
import zmq
import zmq.asyncio
from aiohttp import web

from kvevents import sglang
from kvevents.events import BlockStored
from kvevents.vllm import Event, encode_payload
from kvroute.bench.common import print_fields
from kvroute.devstack.embedded_redis import free_port, redis_url_or_private
from kvroute.devstack.processes import (
    agent_command,
    exited,
    poll_until,
    remove_files,
    serve_app,
    start_logged,
    stop_processes,
)
from kvroute.devstack.stack import metric_value
from kvservice.lifecycle import StartupError
from sim_engine.kv_events import removed_event, stored_event

MODEL = "bench-agent"


@dataclass
class Workload:
    frames: list[list[bytes]]
    block_events: int


def _as_pages(events: list[Event], block_size: int, page_size: int) -> list[Event]:
    """The same events with each block as pages of ``page_size`` tokens (SGLang's radix cache):
    page ``n`` of block ``h`` is hashed ``h * 1000 + n``."""
    pages = block_size // page_size
    paged: list[Event] = []
    for event in events:
        hashes = [int(h) * 1000 + n for h in event.block_hashes for n in range(pages)]  # type: ignore[union-attr]
        if isinstance(event, BlockStored):
            parent = None if event.parent_block_hash is None else int(event.parent_block_hash) * 1000 + pages - 1
            paged.append(stored_event(hashes, parent, event.token_ids, page_size))
        else:
            paged.append(removed_event(hashes))
    return paged


def build_workload(
    batches: int, blocks_per_batch: int, cache_blocks: int, block_size: int, seed: int = 3, page_size: int | None = None
) -> Workload:
    rng = random.Random(seed)
    chains: deque[list[int]] = deque()
    held = 0
    next_hash = 1
    frames: list[list[bytes]] = []
    events_total = 0
    for seq in range(batches):
        events: list[Event] = []
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
        payload = (
            encode_payload(events)
            if page_size is None
            else sglang.encode_payload(_as_pages(events, block_size, page_size))
        )
        frames.append([b"kv", seq.to_bytes(8, "big"), payload])
    return Workload(frames, events_total)


async def _engine_stand_in(port: int) -> web.AppRunner:
    """The engine's HTTP side as the agent sees it: /health and an empty /metrics."""

    async def ok(_: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.router.add_get("/health", ok)
    app.router.add_get("/metrics", ok)
    return await serve_app(app, port)


async def _agent_metric(session: aiohttp.ClientSession, port: int, name: str) -> float | None:
    try:
        return await metric_value(session, f"http://127.0.0.1:{port}", name)
    except aiohttp.ClientError:
        return None


async def _subscribed(pub: zmq.asyncio.Socket, within_s: float) -> None:
    """Until a subscriber's subscription reaches ``pub`` (an XPUB sees it as a message)."""
    async with asyncio.timeout(within_s):
        while not (await pub.recv()).startswith(b"\x01"):
            pass


async def run_benchmark(redis_url: str, args: argparse.Namespace) -> dict[str, float]:
    page_size = args.sglang_page_size
    if page_size is not None and args.block_size % page_size:
        raise StartupError("--block-size must be a multiple of --sglang-page-size")
    workload = build_workload(
        args.batches, args.blocks_per_batch, args.cache_blocks, args.block_size, page_size=page_size
    )
    http_port, metrics_port = free_port(), free_port()
    runner = await _engine_stand_in(http_port)
    context = zmq.asyncio.Context()
    pub = context.socket(zmq.XPUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    command = agent_command(
        f"http://127.0.0.1:{http_port}",
        f"tcp://127.0.0.1:{port}",
        redis_url=redis_url,
        model=MODEL,
        block_size=args.block_size,
        metrics_port=metrics_port,
    )
    if page_size is not None:
        command += ["--engine-kind", "sglang"]
    agent, log = start_logged(command, "bench-agent")
    try:
        async with aiohttp.ClientSession() as session:

            async def metric_is(name: str, value: float) -> bool:
                if (failure := exited(agent, log, "the agent")) is not None:
                    raise failure
                return await _agent_metric(session, metrics_port, name) == value

            await poll_until(lambda: metric_is("kvroute_agent_registered", 1.0), "the agent did not register", 30)
            await _subscribed(pub, 30)
            started = time.perf_counter()
            for frames in workload.frames:
                await pub.send_multipart(frames)
            sent = time.perf_counter() - started
            last = float(len(workload.frames) - 1)

            async def applied() -> bool:
                return await metric_is("kvroute_agent_last_seq", last)

            await poll_until(applied, "the agent did not apply every batch", 600, interval_s=0.02)
            elapsed = time.perf_counter() - started
            gaps = await _agent_metric(session, metrics_port, "kvroute_agent_gaps_total")
            indexed = await _agent_metric(session, metrics_port, "kvroute_agent_mirror_indexed_blocks")
    finally:
        stop_processes([agent], 30)
        remove_files([log])
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
    if args.cache_blocks < args.blocks_per_batch:
        raise StartupError("--cache-blocks must hold at least one batch (--blocks-per-batch)")
    with redis_url_or_private(args.redis_url) as url:
        results = asyncio.run(run_benchmark(url, args))
    print_fields(results)
    return 0
