"""``kvroute demo``: the whole system on this machine, and what KV-aware routing buys.

Starts (unless ``--redis-url`` is given) a private Redis/Valkey server, 4 simulated engines with
an agent process each, and 2 router replicas; drives multi-turn chats over a few shared system
prompts through the routers with the ``kv`` policy, then again (caches reset) with
``round_robin``; prints a table and writes a PNG chart. Everything it started is stopped on exit,
also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from kvindex.settings import RedisSettings
from kvroute.devstack.embedded_redis import redis_url_or_private
from kvroute.devstack.stack import MODEL, Stack, stream_completion
from router.scoring import Policy

SYSTEM_PROMPTS = [
    "You are a meticulous travel planner. Always answer with an itinerary, a budget and a packing list. " * 4,
    "You are a senior Python reviewer. Point out bugs, then style, then performance, citing lines. " * 4,
    "You are a patient maths tutor. Explain each step, then give one practice problem with answers. " * 4,
]
WORDS = ["budget", "museum", "function", "variable", "integral", "train", "hotel", "refactor", "matrix", "ferry",
         "lambda", "theorem", "beach", "closure", "vector", "castle", "async", "proof", "market", "cache"]  # fmt: skip
QUESTIONS = ["Where should I start?", "What about the weekend?", "Can you go deeper?", "Summarise that for me.",
             "What would you change?", "Give me an example.", "And the costs?", "What are the risks?"]  # fmt: skip


@dataclass
class PolicyResult:
    policy: str
    requests: int
    hit_rate: float
    ttft_mean_ms: float
    ttft_p99_ms: float
    requests_per_s: float
    duplication: float
    prediction_accuracy: float
    max_worker_share: float


async def _chat(session: aiohttp.ClientSession, url: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    """One streamed chat completion: time to first token, usage, the routing headers."""
    reply = await stream_completion(session, url, "/v1/chat/completions",
                                    {"model": MODEL, "messages": messages, "max_tokens": 24})  # fmt: skip
    if reply.status != 200:
        raise RuntimeError(f"the router answered {reply.status}: {reply.text}")
    return {"ttft": reply.ttft_s, "usage": reply.usage or {}, "worker": reply.worker,
            "predicted": reply.predicted_cached_tokens}  # fmt: skip


async def _conversation(session: aiohttp.ClientSession, urls: list[str], index: int, turns: int,
                        rng: random.Random, out: list[dict[str, Any]]) -> None:  # fmt: skip
    messages = [{"role": "system", "content": SYSTEM_PROMPTS[index % len(SYSTEM_PROMPTS)]}]
    for turn in range(turns):
        detail = " ".join(rng.choice(WORDS) for _ in range(40))  # pasted notes: history outweighs the system prompt
        messages.append({"role": "user", "content": f"{rng.choice(QUESTIONS)} Notes: {detail}"})
        result = await _chat(session, urls[(index + turn) % len(urls)], messages)
        out.append(result)
        messages.append({"role": "assistant", "content": f"Here is my answer number {turn} for you."})


async def run_policy(stack: Stack, policy: Policy, conversations: int, turns: int) -> PolicyResult:
    await stack.reset_caches()
    urls = await stack.start_routers(policy, replicas=2)
    results: list[dict[str, Any]] = []
    rng = random.Random(42)
    started = time.perf_counter()
    async with aiohttp.ClientSession() as session:
        tasks = [_conversation(session, urls, i, turns, rng, results) for i in range(conversations)]
        progress = asyncio.create_task(_progress(policy, results, conversations * turns))
        await asyncio.gather(*tasks)
        progress.cancel()
    elapsed = time.perf_counter() - started
    duplication = await stack.duplication()
    await stack.stop_routers()
    prompt = sum(r["usage"].get("prompt_tokens", 0) for r in results)
    cached = sum((r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) for r in results)
    exact = sum(
        1 for r in results if r["predicted"] == (r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
    )
    ttfts = sorted(1000 * r["ttft"] for r in results)
    shares = Counter(r["worker"] for r in results)
    return PolicyResult(
        policy=policy.value,
        requests=len(results),
        hit_rate=cached / max(prompt, 1),
        ttft_mean_ms=statistics.mean(ttfts),
        ttft_p99_ms=ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        requests_per_s=len(results) / elapsed,
        duplication=duplication,
        prediction_accuracy=exact / max(len(results), 1),
        max_worker_share=max(shares.values()) / (len(results) / stack.engines),
    )


async def _progress(policy: Policy, results: list[dict[str, Any]], total: int) -> None:
    while True:
        await asyncio.sleep(2)
        print(f"  {policy.value}: {len(results)}/{total} requests", file=sys.stderr, flush=True)


def render(results: list[PolicyResult]) -> str:
    headers = ["policy", "hit rate", "TTFT mean ms", "TTFT p99 ms", "req/s", "duplication", "prediction exact",
               "busiest worker / mean"]  # fmt: skip
    rows = [
        [r.policy, f"{r.hit_rate:.1%}", f"{r.ttft_mean_ms:.1f}", f"{r.ttft_p99_ms:.1f}", f"{r.requests_per_s:.1f}",
         f"{r.duplication:.1%}", f"{r.prediction_accuracy:.1%}", f"{r.max_worker_share:.2f}"]
        for r in results
    ]  # fmt: skip
    widths = [max(len(x) for x in column) for column in zip(headers, *rows, strict=True)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in [headers, *rows]]
    return "\n".join(lines)


def chart(results: list[PolicyResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(11, 3.5))
    names = [r.policy for r in results]
    for axis, values, title in (
        (axes[0], [100 * r.hit_rate for r in results], "cache hit rate (%)"),
        (axes[1], [r.ttft_mean_ms for r in results], "mean time to first token (ms)"),
        (axes[2], [100 * r.duplication for r in results], "blocks cached on >1 worker (%)"),
    ):
        axis.bar(names, values, color=["#2a7", "#888", "#c55"][: len(names)])
        axis.set_title(title, fontsize=10)
    fig.suptitle("kvroute demo: 4 simulated engines, 2 router replicas, multi-turn chats")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


async def run_demo(args: argparse.Namespace) -> list[PolicyResult]:
    with redis_url_or_private(args.redis_url) as url:
        async with Stack(RedisSettings(url=url), engines=args.engines) as stack:
            print(f"started Redis at {url}, {args.engines} simulated engines with agents", file=sys.stderr)
            results = []
            for policy in (Policy.KV, Policy.ROUND_ROBIN):
                print(f"running {args.conversations} conversations x {args.turns} turns with policy {policy.value}",
                      file=sys.stderr)  # fmt: skip
                results.append(await run_policy(stack, policy, args.conversations, args.turns))
            return results


def run_from_args(args: argparse.Namespace) -> int:
    try:
        results = asyncio.run(run_demo(args))
    except KeyboardInterrupt:
        print("interrupted: everything the demo started has been stopped", file=sys.stderr)
        return 130
    print(render(results))
    chart(results, Path(args.chart))
    print(f"\nchart written to {Path(args.chart).resolve()}")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=2))
        print(f"table written to {Path(args.json).resolve()}")
    return 0
