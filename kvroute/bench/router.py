"""``kvroute bench router``: what the router adds to a request, and how many it can route.

A trivial upstream (an aiohttp server answering completions at once, registered as 4 workers in a
private Redis) is called directly and through one ``kvroute router`` process, in the same run:
* added latency (router minus direct, p50/p99) at a fixed open-loop rate for 8k-token token-id
  prompts and for 2k-token text prompts (the router tokenizes those with the tiny model);
* the most requests/s one router process completes for short non-streaming requests.
A bare aiohttp pass-through (:mod:`kvroute.devstack.passthrough`) is measured the same way: the floor of a
Python hop. Optionally the SGLang router (``--sglang``, its cache_aware policy) is measured the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from functools import partial
from typing import Any

import aiohttp
from aiohttp import web

from kvindex.redis_index import RedisIndex
from kvindex.settings import RedisSettings
from kvindex.types import WorkerInfo
from kvroute.bench.common import closed_loop, percentile, remove_files, start_logged, stop_processes, wait_healthy
from kvroute.devstack.embedded_redis import RedisServer, free_port
from kvroute.devstack.passthrough import completions_site
from kvroute.devstack.peers import SglangRouters
from sim_engine.settings import TINY_MODEL_DIR

MODEL = "tiny"
USAGE = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2, "prompt_tokens_details": {"cached_tokens": 0}}
CHOICE = {"index": 0, "text": "ok", "finish_reason": "length"}
REPLY = json.dumps(
    {"id": "cmpl-bench", "object": "text_completion", "created": 0, "model": MODEL, "choices": [CHOICE], "usage": USAGE}
).encode()


async def _upstream(port: int) -> web.AppRunner:
    async def completions(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=REPLY, content_type="application/json")

    return await completions_site(port, completions)


async def _open_loop(session: aiohttp.ClientSession, url: str, bodies: list[bytes], rate: float) -> list[float]:
    """Send ``bodies`` at ``rate`` per second regardless of replies; each one's latency (s)."""
    latencies: list[float] = []
    headers = {"Content-Type": "application/json"}

    async def one(body: bytes) -> None:
        started = time.perf_counter()
        async with session.post(url, data=body, headers=headers) as response:
            await response.read()
            if response.status != 200:
                raise RuntimeError(f"{url} answered {response.status}")
        latencies.append(time.perf_counter() - started)

    tasks = []
    start = time.perf_counter()
    for i, body in enumerate(bodies):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(body)))
    await asyncio.gather(*tasks)
    return latencies


def _short_request(text: bool, i: int, n: int) -> dict[str, Any]:
    """Client ``i``'s ``n``-th request of the max-throughput run."""
    prompt: Any = f"short prompt {i} {n % 97}" if text else [i, n % 97, 5, 6, 7, 8, 9, 10]
    return {"model": MODEL, "prompt": prompt, "max_tokens": 1}


def _bodies(kind: str, count: int, seed: int = 5) -> list[bytes]:
    rng = random.Random(seed)
    shared = [rng.randrange(10, 2000) for _ in range(6000)]
    words = ["cache", "block", "router", "prefix", "token", "engine", "worker", "index"]
    out = []
    for i in range(count):
        if kind == "ids8k":
            prompt: Any = shared + [rng.randrange(10, 2000) for _ in range(2192)] + [i]
        else:  # ~2k tokens of text
            prompt = " ".join(rng.choice(words) for _ in range(1000)) + f" {i}"
        out.append(json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1}).encode())
    return out


async def _measure(
    session: aiohttp.ClientSession,
    name: str,
    url: str,
    direct: str,
    args: argparse.Namespace,
    results: dict[str, Any],
    token_ids: bool = True,
) -> None:
    """``token_ids=False`` for routers that accept only text prompts (SGLang's)."""
    for kind in ("ids8k", "text2k") if token_ids else ("text2k",):
        bodies = _bodies(kind, args.requests)
        await _open_loop(session, url + "/v1/completions", bodies[:50], args.rate)  # warm up
        routed = await _open_loop(session, url + "/v1/completions", bodies, args.rate)
        plain = await _open_loop(session, direct + "/v1/completions", bodies, args.rate)
        results[f"{name}:{kind}"] = {
            "direct_p50_ms": round(1000 * statistics.median(plain), 3),
            "routed_p50_ms": round(1000 * statistics.median(routed), 3),
            "added_p50_ms": round(1000 * (statistics.median(routed) - statistics.median(plain)), 3),
            "added_p99_ms": round(1000 * (percentile(routed, 0.99) - percentile(plain, 0.99)), 3),
        }
    for text in (False, True) if token_ids else (True,):
        urls = [url + "/v1/completions"]
        done, took = await closed_loop(session, urls, args.seconds, args.concurrency, partial(_short_request, text))
        results[f"{name}:max_rps_{'text' if text else 'ids'}"] = round(done / took, 1)


def _start_router(redis_url: str) -> tuple[subprocess.Popen[bytes], str, str]:
    port = free_port()
    command = [sys.executable, "-m", "router", "--redis-url", redis_url, "--port", str(port)]
    command += ["--tokenizer", f"{MODEL}={TINY_MODEL_DIR}", "--log-level", "WARNING"]
    return *start_logged(command, "bench-router"), f"http://127.0.0.1:{port}"


def _start_passthrough(upstream_port: int) -> tuple[subprocess.Popen[bytes], str, str]:
    port = free_port()
    command = [sys.executable, "-m", "kvroute.devstack.passthrough", str(port), f"http://127.0.0.1:{upstream_port}"]
    return *start_logged(command, "bench-passthrough"), f"http://127.0.0.1:{port}"


async def _register_upstreams(redis_url: str, ports: list[int]) -> None:
    """The trivial upstreams as 4 workers of MODEL in the index (an hour's TTL: no agent renews it)."""
    client = RedisSettings(url=redis_url).client()
    try:
        index = RedisIndex(client)
        for i, port in enumerate(ports):
            await index.register(WorkerInfo(f"w{i}", MODEL, f"http://127.0.0.1:{port}", 16), ttl_ms=3_600_000)
    finally:
        await client.aclose()


async def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    upstream_ports = [free_port() for _ in range(4)]
    runners = [await _upstream(port) for port in upstream_ports]
    direct = f"http://127.0.0.1:{upstream_ports[0]}"
    results: dict[str, Any] = {}
    processes: list[subprocess.Popen[bytes]] = []
    logs: list[str] = []
    try:
        with RedisServer() as server:
            await _register_upstreams(server.url, upstream_ports)
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
                for name, start, ready in (
                    ("kvroute", partial(_start_router, server.url), "/ready"),
                    ("passthrough", partial(_start_passthrough, upstream_ports[0]), "/health"),
                ):
                    process, log, url = start()
                    processes.append(process)
                    logs.append(log)
                    await wait_healthy(session, url + ready, process, log, 30, name=f"the {name} process")
                    await _measure(session, name, url, direct, args, results)
                if args.sglang:
                    async with SglangRouters([f"http://127.0.0.1:{p}" for p in upstream_ports]) as sglang:
                        await _measure(session, "sglang", sglang.urls[0], direct, args, results, token_ids=False)
    finally:
        stop_processes(processes)
        remove_files(logs)
        for runner in runners:
            await runner.cleanup()
    return results


def run_from_args(args: argparse.Namespace) -> int:
    results = asyncio.run(run_benchmark(args))
    print(json.dumps(results, indent=2))
    return 0
