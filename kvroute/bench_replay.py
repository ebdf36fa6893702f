"""``kvroute bench replay TRACE``: routing quality on a real trace, policies side by side.

Replays a Mooncake-format trace (one JSON object per line: ``timestamp`` ms, ``input_length``,
``output_length``, ``hash_ids`` - one id per 512-token block, equal ids at equal positions meaning
equal prefixes) through a self-started stack: simulated engines whose caches together hold
``--cache-fraction`` of the replayed requests' distinct blocks, an agent per engine, and N router
replicas, open loop at the trace's timestamps divided by ``--time-scale``. Each hash id becomes 512
deterministic token ids. Outputs are capped (``--max-output``): the cache is what is measured.

Two references are computed offline from the same requests: one shared LRU cache with the fleet's
total capacity, and an infinite cache (the ceiling); the router's hit rate is also shown as a
fraction of the LRU one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections import Counter, OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from kvindex.settings import RedisSettings
from kvroute.embedded_redis import RedisServer
from kvroute.stack import MODEL, Stack, stream_completion
from router.scoring import Policy
from sim_engine.engine import TimingModel

TRACE_BLOCK = 512


@dataclass(frozen=True)
class TraceRequest:
    at_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass
class RunResult:
    policy: str
    replicas: int
    requests: int
    failed: int
    hit_rate: float
    of_lru_reference: float
    ttft_mean_ms: float
    ttft_p99_ms: float
    busiest_worker_vs_mean: float
    ttft_ms: list[float]


def load_trace(path: Path, limit: int, max_input: int) -> list[TraceRequest]:
    out: list[TraceRequest] = []
    with path.open() as fh:
        for line in fh:
            if len(out) >= limit:
                break
            row = json.loads(line)
            if row["input_length"] > max_input:
                continue
            out.append(TraceRequest(row["timestamp"] / 1000, row["input_length"], row["output_length"],
                                    tuple(row["hash_ids"])))  # fmt: skip
    return out


SYNTHETIC = ("shared-prefix", "multi-turn", "documents")


def synthetic_trace(kind: str, count: int, seed: int = 11, rate: float = 4.0) -> list[TraceRequest]:
    """Built-in workloads in the trace's terms (512-token blocks as ids), Poisson arrivals at
    ``rate`` per second: SGLang-style shared-prefix groups, multi-turn chats, long documents."""
    rng = random.Random(seed)
    next_id = iter(range(1_000_000, 10**9))
    at, out = 0.0, []
    groups = [[next(next_id) for _ in range(8)] for _ in range(16)]  # 16 prefixes of 4k tokens
    documents = [[next(next_id) for _ in range(24)] for _ in range(12)]  # 12 documents of 12k tokens
    chats: list[list[int]] = [[] for _ in range(48)]
    for _ in range(count):
        at += rng.expovariate(rate)
        if kind == "shared-prefix":
            ids = [*rng.choice(groups), next(next_id)]
        elif kind == "documents":
            ids = [*rng.choice(documents), next(next_id)]
        elif kind == "multi-turn":
            chat = rng.choice(chats)
            if len(chat) > 24:
                chat.clear()  # the conversation ends; a new one starts in its slot
            chat += [next(next_id) for _ in range(rng.randint(1, 2))]
            ids = list(chat)
        else:
            raise ValueError(f"unknown synthetic workload {kind!r}; choose from {', '.join(SYNTHETIC)}")
        out.append(TraceRequest(at, len(ids) * TRACE_BLOCK - rng.randint(0, 200), 8, tuple(ids)))
    return out


def tokens_of(request: TraceRequest, cache: dict[int, list[int]]) -> list[int]:
    tokens: list[int] = []
    for hash_id in request.hash_ids:
        block = cache.get(hash_id)
        if block is None:
            rng = random.Random(hash_id)
            block = cache[hash_id] = [rng.randrange(10, 2000) for _ in range(TRACE_BLOCK)]
        tokens += block
    return tokens[: request.input_length]


def reference_hit_rates(requests: list[TraceRequest], capacity_blocks: int) -> tuple[float, float]:
    """(shared LRU cache of ``capacity_blocks`` 512-token blocks, infinite cache) hit rates."""
    lru: OrderedDict[int, None] = OrderedDict()
    seen: set[int] = set()
    prompt = lru_hits = infinite_hits = 0
    for request in requests:
        prompt += request.input_length
        cap = request.input_length - 1
        depth = next((i for i, h in enumerate(request.hash_ids) if h not in lru), len(request.hash_ids))
        lru_hits += min(depth * TRACE_BLOCK, cap)
        depth = next((i for i, h in enumerate(request.hash_ids) if h not in seen), len(request.hash_ids))
        infinite_hits += min(depth * TRACE_BLOCK, cap)
        for hash_id in request.hash_ids:
            lru[hash_id] = None
            lru.move_to_end(hash_id)
            seen.add(hash_id)
        while len(lru) > capacity_blocks:
            lru.popitem(last=False)
    return lru_hits / max(prompt, 1), infinite_hits / max(prompt, 1)


async def _one(session: aiohttp.ClientSession, url: str, tokens: list[int], max_tokens: int) -> dict[str, Any]:
    reply = await stream_completion(session, url, "/v1/completions",
                                    {"model": MODEL, "prompt": tokens, "max_tokens": max_tokens})  # fmt: skip
    if reply.status != 200:
        return {"failed": True}
    return {"failed": False, "ttft": reply.ttft_s, "usage": reply.usage or {}, "worker": reply.worker}


async def replay(stack: Stack, requests: list[TraceRequest], policy: Policy, replicas: int,
                 args: argparse.Namespace, lru: float) -> RunResult:  # fmt: skip
    await stack.reset_caches()
    urls = await stack.start_routers(policy, replicas)
    token_cache: dict[int, list[int]] = {}
    bodies = [tokens_of(r, token_cache) for r in requests]
    results: list[dict[str, Any]] = []
    start = time.perf_counter()

    async def send(i: int, request: TraceRequest) -> None:
        delay = start + request.at_s / args.time_scale - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        results.append(await _one(session, urls[i % len(urls)], bodies[i], min(request.output_length, args.max_output)))

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(send(i, r) for i, r in enumerate(requests)))
    await stack.stop_routers()
    done = [r for r in results if not r["failed"]]
    prompt = sum(r["usage"].get("prompt_tokens", 0) for r in done)
    cached = sum((r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) for r in done)
    ttfts = sorted(1000 * r["ttft"] for r in done)
    shares = Counter(r["worker"] for r in done)
    hit_rate = cached / max(prompt, 1)
    return RunResult(
        policy=policy.value,
        replicas=replicas,
        requests=len(results),
        failed=len(results) - len(done),
        hit_rate=hit_rate,
        of_lru_reference=hit_rate / max(lru, 1e-9),
        ttft_mean_ms=statistics.mean(ttfts),
        ttft_p99_ms=ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        busiest_worker_vs_mean=max(shares.values()) / (len(done) / stack.engines),
        ttft_ms=[round(t, 2) for t in ttfts],
    )


async def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    if args.synthetic:
        requests = synthetic_trace(args.synthetic, args.limit)
    else:
        requests = load_trace(Path(args.trace), args.limit, args.max_input)
    distinct = len({h for r in requests for h in r.hash_ids})
    capacity_trace_blocks = max(1, int(distinct * args.cache_fraction))
    per_engine_blocks = capacity_trace_blocks * (TRACE_BLOCK // args.block_size) // args.engines + 1
    needed = max(r.input_length + args.max_output for r in requests) // args.block_size + 2
    if per_engine_blocks < needed:
        # An engine must fit the largest request: grow the caches and say so (the references use
        # the same, effective capacity).
        print(f"note: {args.cache_fraction:.0%} of the distinct blocks gives each engine {per_engine_blocks} blocks, "
              f"less than the largest request's {needed}: using {needed}", file=sys.stderr)  # fmt: skip
        per_engine_blocks = needed
        capacity_trace_blocks = per_engine_blocks * args.engines * args.block_size // TRACE_BLOCK
    lru, infinite = reference_hit_rates(requests, capacity_trace_blocks)
    timing = TimingModel(prefill_ms_per_1k_tokens=args.prefill_ms_per_1k, decode_ms_per_step=5,
                         max_running=args.max_running, speedup=args.time_scale)  # fmt: skip
    server = RedisServer().start()
    runs = []
    try:
        stack = Stack(RedisSettings(url=server.url), engines=args.engines, num_blocks=per_engine_blocks,
                      block_size=args.block_size, timing=timing, max_model_len=needed * args.block_size)  # fmt: skip
        async with stack:
            for replicas in (int(r) for r in args.replicas.split(",")):
                for policy in (Policy(p) for p in args.policies.split(",")):
                    print(f"replaying {len(requests)} requests: {policy.value}, {replicas} replica(s)", file=sys.stderr)
                    runs.append(await replay(stack, requests, policy, replicas, args, lru))
    finally:
        server.stop()
    return {"requests": len(requests), "distinct_trace_blocks": distinct,
            "cache_fraction": capacity_trace_blocks / max(distinct, 1),
            "engines": args.engines, "lru_reference_hit_rate": lru, "infinite_cache_hit_rate": infinite,
            "runs": [asdict(r) for r in runs]}  # fmt: skip


def render(results: dict[str, Any]) -> str:
    lines = [f"{results['requests']} requests, {results['engines']} engines, caches = "
             f"{results['cache_fraction']:.0%} of {results['distinct_trace_blocks']} distinct blocks; references: "
             f"shared LRU {results['lru_reference_hit_rate']:.1%}, infinite {results['infinite_cache_hit_rate']:.1%}",
             "policy        replicas  hit rate  of LRU   TTFT mean ms  TTFT p99 ms  busiest/mean  failed"]  # fmt: skip
    for r in results["runs"]:
        lines.append(f"{r['policy']:<13} {r['replicas']:<9} {r['hit_rate']:<9.1%} {r['of_lru_reference']:<8.1%} "
                     f"{r['ttft_mean_ms']:<13.1f} {r['ttft_p99_ms']:<12.1f} {r['busiest_worker_vs_mean']:<13.2f} "
                     f"{r['failed']}")  # fmt: skip
    return "\n".join(lines)


def chart(results: dict[str, Any], path: Path) -> None:
    """Hit rate per run against the two references, and each run's TTFT distribution."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"{r['policy']}\n{r['replicas']} replica(s)" for r in runs]
    left.bar(labels, [100 * r["hit_rate"] for r in runs], color="#2a7")
    left.axhline(100 * results["lru_reference_hit_rate"], color="#555", linestyle="--", label="one shared LRU cache")
    left.axhline(100 * results["infinite_cache_hit_rate"], color="#c55", linestyle=":", label="infinite cache")
    left.set_title("cache hit rate (%)", fontsize=10)
    left.legend(fontsize=8)
    for r, label in zip(runs, labels, strict=True):
        ttfts = sorted(r["ttft_ms"])
        right.plot(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], label=label.replace("\n", ", "))
    right.set_xscale("log")
    right.set_title("time to first token (ms), CDF", fontsize=10)
    right.legend(fontsize=8)
    fig.suptitle(f"kvroute bench replay: {results['requests']} requests, {results['engines']} engines")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_from_args(args: argparse.Namespace) -> int:
    results = asyncio.run(run_benchmark(args))
    print(render(results))
    chart(results, Path(args.chart))
    print(f"chart written to {Path(args.chart).resolve()}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0
