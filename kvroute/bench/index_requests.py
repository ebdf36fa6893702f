"""``kvroute bench index --trace FILE``: Redis CPU per request of a Mooncake-format trace, all of it.

Each request of the trace is routed and cached the way a fleet does it, through the real index:
- a match of its prompt (page_match.lua with liveness: the router's read);
- the chosen worker stores the prompt's blocks it lacks (page_apply.lua, claim.lua, tally.lua);
- the worker evicts its least recently used blocks beyond its cache, the tails of chains first,
  as vLLM frees a request's blocks in reverse order;
- each worker reports its load every ``LOAD_EVERY`` requests (load.lua), as an agent's scrape does.

The worker chosen is the longest match, ties to the one with the fewest blocks. No engine runs:
the figure is what Redis spends per request, split by script, from INFO commandstats (a single
Redis).
"""

from __future__ import annotations

import asyncio
import random
import struct
import time
from collections import OrderedDict
from pathlib import Path

import xxhash
from redis.asyncio import Redis

from kvindex.redis_index import RedisIndex
from kvindex.redis_worker import RedisWorker
from kvindex.types import RemovedBlocks, StoredRun, WorkerInfo, WorkerLoad
from kvroute.bench.common import single_redis_client
from kvroute.bench.replay_workload import TRACE_BLOCK, load_trace

BLOCK_TOKENS = 16
LOAD_EVERY = 16  # requests between a worker's load reports (an agent scrapes about every 100 ms)


def chain_of(hash_ids: tuple[int, ...], input_length: int) -> list[int]:
    """The prompt's chain of 16-token blocks: each trace block id stands for 512 tokens (32
    blocks); a block's hash is its parent's and its own place, so chains sharing ids share hashes."""
    blocks = input_length // BLOCK_TOKENS
    chain: list[int] = []
    parent = 0
    for hash_id in hash_ids:
        for j in range(TRACE_BLOCK // BLOCK_TOKENS):
            if len(chain) == blocks:
                return chain
            parent = xxhash.xxh3_64_intdigest(struct.pack(">QQI", parent, hash_id, j))
            chain.append(parent)
    return chain


class CachedWorker:
    """One worker's cache: its blocks in least-recently-used order, and its index handle."""

    def __init__(self, handle: RedisWorker, capacity: int) -> None:
        self.handle, self.capacity = handle, capacity
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.requests = 0

    def held_prefix(self, chain: list[int]) -> int:
        return next((i for i, block in enumerate(chain) if block not in self.lru), len(chain))

    async def serve(self, chain: list[int]) -> None:
        held = self.held_prefix(chain)
        changes: list[StoredRun | RemovedBlocks] = []
        if held < len(chain):
            changes.append(StoredRun(chain[held - 1] if held else None, tuple(chain[held:])))
        for block in reversed(chain):  # the first block the most recent: a chain's tail goes first
            self.lru[block] = None
            self.lru.move_to_end(block)
        evicted = []
        while len(self.lru) > self.capacity:
            evicted.append(self.lru.popitem(last=False)[0])
        if evicted:
            changes.append(RemovedBlocks(tuple(evicted)))
        await self.handle.apply(changes)
        self.requests += 1
        if self.requests % LOAD_EVERY == 0:
            await self.handle.report_load(WorkerLoad(1, 0, len(self.lru) / self.capacity, self.capacity))


# The scripts, and the GET that confirms a router's copy of the alive gids between scripts
# (kvindex.alive_cache; the scripts' own GETs are counted in it too: a few a second).
SCRIPT_COMMANDS = {"evalsha": "writes", "eval": "writes", "evalsha_ro": "reads", "eval_ro": "reads", "get": "reads"}


async def _cpu_us(client: Redis) -> float:
    info = await client.info("cpu")
    return 1e6 * (float(info["used_cpu_user"]) + float(info["used_cpu_sys"]))


async def _script_totals(client: Redis) -> dict[str, float]:
    """The scripts' time, reads and writes apart, and their calls (commandstats counts the
    commands a script calls once more under their own names: only the script commands count)."""
    stats = await client.info("commandstats")
    out = {"reads": 0.0, "writes": 0.0, "calls": 0.0}
    for name, kind in SCRIPT_COMMANDS.items():
        command = stats.get(f"cmdstat_{name}", {})
        out[kind] += float(command.get("usec", 0))
        out["calls"] += int(command.get("calls", 0))
    return out


async def run_trace(url: str, trace: Path, requests: int, workers: int, capacity: int) -> dict[str, object]:
    client = single_redis_client(url)
    index = RedisIndex(client)
    model = "bench-trace"
    fleet = []
    for w in range(workers):
        handle = await index.register(WorkerInfo(f"w{w}", model, f"http://w{w}", BLOCK_TOKENS), 3_600_000)
        fleet.append(CachedWorker(handle, capacity))
    rows = load_trace(trace, requests, 10**9)
    chains = [chain_of(r.hash_ids, r.input_length) for r in rows]
    warm = len(chains) // 5
    rng = random.Random(3)
    started = 0.0
    for i, chain in enumerate(chains):
        if i == warm:  # the caches have filled: measure from here
            await client.config_resetstat()
            started, cpu_before = time.perf_counter(), await _cpu_us(client)
        matches = await index.match(model, chain)
        best = max(matches.values(), default=0)
        ties = [w for w in fleet if matches.get(w.handle.worker_id, 0) == best]
        chosen = min(ties, key=lambda w: (len(w.lru), rng.random()))
        await chosen.serve(chain)
    elapsed = time.perf_counter() - started
    process_us = await _cpu_us(client) - cpu_before
    scripts = await _script_totals(client)
    measured = len(chains) - warm
    await client.aclose()
    return {
        "requests": measured,
        "workers": workers,
        "capacity_blocks": capacity,
        "blocks_per_prompt": sum(len(c) for c in chains) / len(chains),
        "script_us_per_request": (scripts["reads"] + scripts["writes"]) / measured,
        "read_script_us_per_request": scripts["reads"] / measured,
        "write_script_us_per_request": scripts["writes"] / measured,
        "process_cpu_us_per_request": process_us / measured,
        "script_calls_per_request": scripts["calls"] / measured,
        "seconds": elapsed,
    }


def render_trace(results: dict[str, object]) -> str:
    r = results
    return (
        f"{r['requests']} requests ({r['blocks_per_prompt']:.0f} blocks a prompt), {r['workers']} workers of "
        f"{r['capacity_blocks']} blocks: scripts {r['script_us_per_request']:.0f} us of Redis CPU per request "
        f"(reads {r['read_script_us_per_request']:.0f}, writes {r['write_script_us_per_request']:.0f}; "
        f"{r['script_calls_per_request']:.1f} calls); the Redis process {r['process_cpu_us_per_request']:.0f} us"
    )


def run_trace_benchmark(url: str, trace: str, requests: int, workers: int, capacity: int) -> dict[str, object]:
    return asyncio.run(run_trace(url, Path(trace), requests, workers, capacity))
