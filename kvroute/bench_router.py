"""``kvroute bench router``: what the router adds to a request, and how many it can route.

A trivial upstream (an aiohttp server answering completions at once, registered as 4 workers in a
private Redis) is called directly and through one ``kvroute router`` process, in the same run:
* added latency (router minus direct, p50/p99) at a fixed open-loop rate for 8k-token token-id
  prompts and for 2k-token text prompts (the router tokenizes those with the tiny model);
* the most requests/s one router process completes for short non-streaming requests.
A bare aiohttp pass-through (``kvroute.passthrough``) is measured the same way: the floor of a
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
from typing import Any

import aiohttp
from aiohttp import web

from kvindex.redis_index import RedisIndex
from kvindex.settings import RedisSettings
from kvindex.types import WorkerInfo
from kvroute.embedded_redis import RedisServer, free_port
from kvroute.passthrough import completions_site
from kvroute.peers import SglangRouters
from sim_engine.settings import TINY_MODEL_DIR

MODEL = "tiny"
REPLY = json.dumps({"id": "cmpl-bench", "object": "text_completion", "created": 0, "model": MODEL,
                    "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2,
                              "prompt_tokens_details": {"cached_tokens": 0}}}).encode()  # fmt: skip


async def _upstream(port: int) -> web.AppRunner:
    async def completions(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=REPLY, content_type="application/json")

    return await completions_site(port, completions)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


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


async def _closed_loop(
    session: aiohttp.ClientSession, url: str, seconds: float, concurrency: int, text: bool = False
) -> float:
    done = 0
    deadline = time.perf_counter() + seconds

    async def client(i: int) -> None:
        nonlocal done
        n = 0
        while time.perf_counter() < deadline:
            prompt: Any = f"short prompt {i} {n % 97}" if text else [i, n % 97, 5, 6, 7, 8, 9, 10]
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
            async with session.post(url, json=body) as response:
                await response.read()
                done += response.status == 200
            n += 1

    started = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(concurrency)))
    return done / (time.perf_counter() - started)


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


async def _wait_up(session: aiohttp.ClientSession, url: str) -> None:
    last = "no answer"
    for _ in range(300):
        try:
            async with session.get(url) as response:
                if response.status == 200:
                    return
                last = f"{response.status} {await response.text()}"
        except aiohttp.ClientError as exc:
            last = repr(exc)
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not come up: {last}")


async def _measure(session: aiohttp.ClientSession, name: str, url: str, direct: str, args: argparse.Namespace,
                   results: dict[str, Any], token_ids: bool = True) -> None:  # fmt: skip
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
            "added_p99_ms": round(1000 * (_percentile(routed, 0.99) - _percentile(plain, 0.99)), 3),
        }
    for text in (False, True) if token_ids else (True,):
        rps = await _closed_loop(session, url + "/v1/completions", args.seconds, args.concurrency, text)
        results[f"{name}:max_rps_{'text' if text else 'ids'}"] = round(rps, 1)


async def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    server = RedisServer().start()
    upstream_ports = [free_port() for _ in range(4)]
    runners = [await _upstream(port) for port in upstream_ports]
    client = RedisSettings(url=server.url).client()
    index = RedisIndex(client)
    for i, port in enumerate(upstream_ports):
        await index.register(WorkerInfo(f"w{i}", MODEL, f"http://127.0.0.1:{port}", 16), ttl_ms=3_600_000)
    router_port = free_port()
    command = [sys.executable, "-m", "router", "--redis-url", server.url, "--port", str(router_port),
               "--tokenizer", f"{MODEL}={TINY_MODEL_DIR}", "--log-level", "WARNING"]  # fmt: skip
    router = subprocess.Popen(command, stderr=subprocess.DEVNULL)  # noqa: ASYNC220 - starting it does not block
    passthrough = None
    results: dict[str, Any] = {}
    try:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            await _wait_up(session, f"http://127.0.0.1:{router_port}/ready")
            direct = f"http://127.0.0.1:{upstream_ports[0]}"
            await _measure(session, "kvroute", f"http://127.0.0.1:{router_port}", direct, args, results)
            passthrough, passthrough_url = _start_passthrough(upstream_ports[0])
            await _wait_up(session, passthrough_url + "/health")
            await _measure(session, "passthrough", passthrough_url, direct, args, results)
            if args.sglang:
                async with SglangRouters([f"http://127.0.0.1:{p}" for p in upstream_ports]) as sglang:
                    await _measure(session, "sglang", sglang.urls[0], direct, args, results, token_ids=False)
    finally:
        router.terminate()
        router.wait(10)
        if passthrough is not None:
            passthrough.terminate()
            passthrough.wait(10)
        for runner in runners:
            await runner.cleanup()
        await client.aclose()
        server.stop()
    return results


def _start_passthrough(upstream_port: int) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    command = [sys.executable, "-m", "kvroute.passthrough", str(port), f"http://127.0.0.1:{upstream_port}"]
    return subprocess.Popen(command, stderr=subprocess.DEVNULL), f"http://127.0.0.1:{port}"


def run_from_args(args: argparse.Namespace) -> int:
    results = asyncio.run(run_benchmark(args))
    print(json.dumps(results, indent=2))
    return 0
