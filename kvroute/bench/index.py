"""``kvroute bench index``: how fast and how big the shared index is.

Loads a realistic index (every worker holds a few shared system prompts; each conversation's
long tail is held by one primary worker and sometimes a second one with a shorter prefix), then
times ``match`` from the client and reads Redis's own CPU time per match from INFO commandstats,
measures ingest with concurrent writers, and memory per (block, worker) entry. On a cluster
(``--cluster`` or a ``redis+cluster://`` URL) the work is :mod:`kvroute.bench.index_cluster`'s.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from redis.asyncio import Redis

from kvindex.cluster import is_cluster_url
from kvindex.redis_index import RedisIndex
from kvindex.types import StoredRun, WorkerInfo
from kvroute.bench.common import percentile, single_redis_client, write_json
from kvroute.devstack.embedded_redis import redis_url_or_private
from kvservice.lifecycle import StartupError

SYSTEM_PROMPTS = 8
SYSTEM_BLOCKS = 32
MAX_CHAIN = 2048


@dataclass
class MatchRow:
    prompt_blocks: int
    workers: int
    layout: str
    p50_ms: float
    p99_ms: float
    redis_us_per_call: float


@dataclass
class Fleet:
    model: str
    workers: int
    conversations: list[list[int]]
    entries: int
    memory_bytes: int


async def _redis_cpu_us_per_match(client: Redis, matches: int) -> float:
    """The Redis CPU per match: page_match.lua and alive_since.lua are read-only (EVALSHA_RO),
    EVALSHA is counted too, for servers that lack EVALSHA_RO (Redis < 7); and the GET of the
    alive version that confirms a router's copy between scripts (kvindex.alive_cache; a GET
    inside alive_since.lua, once a second, is counted twice: a fraction of a us)."""
    stats = await client.info("commandstats")
    commands = ("evalsha", "evalsha_ro", "eval_ro", "get")
    usec = sum(float(stats.get(f"cmdstat_{cmd}", {}).get("usec", 0)) for cmd in commands)
    return usec / matches if matches else float("nan")


async def load_fleet(client: Redis, model: str, workers: int, entries: int, seed: int = 7) -> Fleet:
    rng = random.Random(seed)
    index = RedisIndex(client)
    for w in range(workers):
        await index.register(WorkerInfo(f"w{w}", model, f"http://10.0.0.{w}:8000", 32), 3_600_000)
    memory_before = int((await client.info("memory"))["used_memory"])
    systems = [[rng.getrandbits(64) for _ in range(SYSTEM_BLOCKS)] for _ in range(SYSTEM_PROMPTS)]
    for w in range(workers):
        await index.handle(model, f"w{w}").store([StoredRun(None, tuple(s)) for s in systems])
    loaded = workers * SYSTEM_PROMPTS * SYSTEM_BLOCKS
    conversations: list[list[int]] = []
    while loaded < entries:
        system = systems[len(conversations) % SYSTEM_PROMPTS]
        chain = system + [rng.getrandbits(64) for _ in range(MAX_CHAIN - SYSTEM_BLOCKS)]
        conversations.append(chain)
        holders = [(rng.randrange(workers), rng.randint(MAX_CHAIN // 8, MAX_CHAIN))]
        if rng.random() < 0.5:
            holders.append((rng.randrange(workers), rng.randint(SYSTEM_BLOCKS + 1, holders[0][1])))
        for worker, depth in holders:
            result = await index.handle(model, f"w{worker}").store(
                [StoredRun(chain[SYSTEM_BLOCKS - 1], tuple(chain[SYSTEM_BLOCKS:depth]))]
            )
            loaded += result.applied
    stats = await index.stats(model)
    memory_after = int((await client.info("memory"))["used_memory"])
    return Fleet(model, workers, conversations, stats.entries, memory_after - memory_before)


async def time_matches(client: Redis, model: str, chains: list[list[int]]) -> tuple[float, float, float]:
    index = RedisIndex(client)
    await index.match(model, chains[0])  # load the script, warm the gid name cache
    await client.config_resetstat()
    samples = []
    for chain in chains:
        start = time.perf_counter()
        await index.match(model, chain)
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples), percentile(samples, 0.99), await _redis_cpu_us_per_match(client, len(chains))


async def adversarial_chain(client: Redis, workers: int, blocks: int) -> tuple[str, list[int]]:
    """Every worker holds a different prefix of one chain: as many distinct match lengths as workers."""
    model = f"bench-adversarial-{workers}-{blocks}"
    index = RedisIndex(client)
    chain = [random.Random(blocks).getrandbits(64) for _ in range(blocks)]
    for w in range(workers):
        await index.register(WorkerInfo(f"w{w}", model, f"http://w{w}", 32), 3_600_000)
        await index.handle(model, f"w{w}").store([StoredRun(None, tuple(chain[: (w + 1) * blocks // workers]))])
    return model, chain


async def measure_ingest(url: str, writers: int, blocks_per_writer: int, run_blocks: int = 64) -> float:
    clients = [single_redis_client(url) for _ in range(writers)]
    indexes = [RedisIndex(c) for c in clients]
    handles = [
        await index.register(WorkerInfo(f"ingest{i}", "bench-ingest", f"http://ingest{i}", 32), 3_600_000)
        for i, index in enumerate(indexes)
    ]

    async def write(i: int) -> None:
        rng = random.Random(i)
        parent = None
        for _ in range(blocks_per_writer // run_blocks):
            run = tuple(rng.getrandbits(64) for _ in range(run_blocks))
            await handles[i].store([StoredRun(parent, run)])
            parent = None if rng.random() < 0.25 else run[-1]

    start = time.perf_counter()
    await asyncio.gather(*(write(i) for i in range(writers)))
    elapsed = time.perf_counter() - start
    for c in clients:
        await c.aclose()
    return writers * (blocks_per_writer // run_blocks) * run_blocks / elapsed


async def run_benchmark(url: str, args: argparse.Namespace) -> dict[str, object]:
    client = single_redis_client(url)
    rows: list[MatchRow] = []
    memory: list[dict[str, float]] = []
    rng = random.Random(11)
    for workers in args.workers:
        fleet = await load_fleet(client, f"bench-w{workers}", workers, args.entries)
        memory.append(
            {"workers": workers, "entries": fleet.entries, "bytes_per_entry": fleet.memory_bytes / fleet.entries}
        )
        print(
            f"loaded {fleet.entries} entries for {workers} workers ({fleet.memory_bytes / fleet.entries:.1f} B/entry)"
        )
        for blocks in args.prompt_blocks:
            chains = [rng.choice(fleet.conversations)[:blocks] for _ in range(args.queries)]
            p50, p99, cpu = await time_matches(client, fleet.model, chains)
            rows.append(MatchRow(blocks, workers, "shared prefixes", p50, p99, cpu))
            print(f"  {blocks:5d} blocks: p50 {p50:.3f} ms  p99 {p99:.3f} ms  redis {cpu:.1f} us/match")
    model, chain = await adversarial_chain(client, 64, 512)
    p50, p99, cpu = await time_matches(client, model, [chain] * args.queries)
    rows.append(MatchRow(512, 64, "adversarial: 64 distinct depths", p50, p99, cpu))
    ingest = await measure_ingest(url, args.writers, 200_000 // args.writers * 4)
    await client.aclose()
    return {
        "match": [asdict(r) for r in rows],
        "memory": memory,
        "ingest_blocks_per_s": ingest,
        "writers": args.writers,
    }


def render(results: dict[str, object]) -> str:
    lines = ["| prompt blocks | workers | layout | p50 ms | p99 ms | Redis CPU us/match |", "|---|---|---|---|---|---|"]
    for r in results["match"]:  # type: ignore[attr-defined]
        lines.append(
            f"| {r['prompt_blocks']} | {r['workers']} | {r['layout']} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} "
            f"| {r['redis_us_per_call']:.1f} |"
        )
    lines += ["", "| workers | entries | bytes per entry |", "|---|---|---|"]
    for m in results["memory"]:  # type: ignore[attr-defined]
        lines.append(f"| {m['workers']} | {m['entries']} | {m['bytes_per_entry']:.1f} |")
    lines += [
        "",
        f"Ingest with {results['writers']} concurrent writers: {results['ingest_blocks_per_s']:,.0f} blocks/s",
    ]
    return "\n".join(lines)


def run_from_args(args: argparse.Namespace) -> int:
    if args.cluster or (args.redis_url and is_cluster_url(args.redis_url)):
        from kvroute.bench.index_cluster import run_cluster_from_args

        return run_cluster_from_args(args)
    if args.read_from_replicas:
        raise StartupError("--read-from-replicas needs --cluster or a redis+cluster:// --redis-url")
    if args.trace:
        return _run_trace(args)
    with redis_url_or_private(args.redis_url) as url:
        results = asyncio.run(run_benchmark(url, args))
    print()
    print(render(results))
    if args.json:
        write_json(args.json, results)
    return 0


def _run_trace(args: argparse.Namespace) -> int:
    from kvroute.bench.index_requests import render_trace, run_trace_benchmark

    if not Path(args.trace).is_file():
        raise StartupError(f"--trace {args.trace}: no such file")
    with redis_url_or_private(args.redis_url) as url:
        results = run_trace_benchmark(url, args.trace, args.trace_requests, args.trace_workers, args.trace_capacity)
    print(render_trace(results))
    if args.json:
        write_json(args.json, results)
    return 0
