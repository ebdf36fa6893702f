"""``kvroute bench hybrid``: what a hybrid model's decision reads beside the match (docs/router.md,
"Hybrid and sliding-window models"): the match alone against the match and the window group's
blocks (router.routing.hybrid), on one prompt and a fleet whose workers hold it to different depths,
half of them keeping the window below their depth (settled by the first read), half not."""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from kvindex.groups import GroupSpec, group_block_hash
from kvindex.hashing import sequence_hashes
from kvindex.redis_index import RedisIndex
from kvindex.settings import RedisSettings
from kvindex.types import StoredRun, WorkerInfo
from kvroute.devstack.embedded_redis import redis_url_or_private
from router.routing.hybrid import hybrid_matches

BLOCK_SIZE = 32


async def _timed(
    index: RedisIndex, model: str, chain: list[int], tokens: int, groups: tuple[GroupSpec, ...], n: int
) -> tuple[float, float]:
    samples = []
    for _ in range(n):
        started = time.perf_counter()
        matches = await index.match(model, chain)
        if groups:
            await hybrid_matches(index, model, groups, chain, tokens, BLOCK_SIZE, matches)
        samples.append((time.perf_counter() - started) * 1000)
    samples.sort()
    return statistics.median(samples), samples[int(len(samples) * 0.9)]


async def run_benchmark(url: str, args: argparse.Namespace) -> None:
    client = RedisSettings(url=url).client()
    index = RedisIndex(client)
    model = f"bench-hybrid-{random.randrange(1 << 30)}"
    groups = (GroupSpec(0, "sliding_window", BLOCK_SIZE, args.window), GroupSpec(1, "full_attention", BLOCK_SIZE))
    rng = random.Random(1)
    prompt = [rng.randrange(5, 2000) for _ in range(args.prompt_tokens)]
    chain = sequence_hashes(prompt, BLOCK_SIZE)
    need = groups[0].run_needed()
    for w in range(args.workers):
        handle = await index.register(WorkerInfo(f"w{w}", model, f"http://w{w}", BLOCK_SIZE), 600_000)
        depth = len(chain) * (w + 1) // args.workers
        shift = 0 if w % 2 == 0 else 3  # odd workers keep their window 3 blocks short of their depth
        window = range(max(depth - need - shift, 0), max(depth - shift, 0))
        await handle.apply(
            [
                StoredRun(None, tuple(chain[:depth])),
                *(StoredRun(None, (group_block_hash(chain[i], 0),)) for i in window),
            ]
        )
    try:
        for label, used in (("match alone", ()), ("match + window blocks", groups)):
            median, p90 = await _timed(index, model, chain, len(prompt), used, args.queries)
            print(f"{label}: median {median:.3f} ms, p90 {p90:.3f} ms")
    finally:
        for w in range(args.workers):
            await index.handle(model, f"w{w}").deregister()
        await client.aclose()


def run_from_args(args: argparse.Namespace) -> int:
    print(
        f"{args.workers} workers, a {args.prompt_tokens}-token prompt at block size {BLOCK_SIZE}, "
        f"a sliding window of {args.window} tokens; {args.queries} decisions each"
    )
    with redis_url_or_private(args.redis_url) as url:
        asyncio.run(run_benchmark(url, args))
    return 0
