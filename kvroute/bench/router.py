"""``kvroute bench router``: what the router adds to a request, and how many it can route.

A trivial upstream (an aiohttp server answering completions and chat completions at once,
registered as 4 workers in a private Redis) is called directly and through one ``kvroute router``
process, in the same run:
* added latency (router minus direct, p50/p99) at a fixed open-loop rate for 8k-token token-id
  prompts and for 2k-token text prompts (the router tokenizes those with the tiny model), and at
  ``MULTI_TURN_RATE`` for multi-turn conversations (shared system prompts, 0.5-2.5k tokens) sent
  as chats (``chat``) and as completions of their transcript (``turns``);
* the most requests/s one router process, and one ``--workers 2`` router, completes for short
  non-streaming requests;
* the router process's CPU per request (``cpu_us``: from /proc, robust to a shared machine);
* the same router on aiohttp's low-level server (``kvroute_aiohttp``: ``--http-server aiohttp``),
  8k ids and 2k text and the most requests/s, beside the built-in server; and on aiohttp's client
  to the workers (``kvroute_aiohttp_client``: ``--upstream-client aiohttp``).
A bare aiohttp pass-through (:mod:`kvroute.devstack.passthrough`) is measured the same way: the floor of a
Python hop. Optionally the SGLang router (``--sglang``, its cache_aware policy) is measured the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from kvindex.redis_index import RedisIndex
from kvindex.settings import RedisSettings
from kvindex.types import WorkerInfo
from kvroute.bench.common import closed_loop, percentile
from kvroute.devstack.embedded_redis import RedisServer, free_port
from kvroute.devstack.peers import SglangRouters
from kvroute.devstack.processes import remove_files, serve_app, start_logged, stop_processes, wait_healthy
from sim_engine.settings import TINY_MODEL_DIR

MODEL = "tiny"
USAGE = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2, "prompt_tokens_details": {"cached_tokens": 0}}
CHOICE = {"index": 0, "text": "ok", "finish_reason": "length"}
REPLY = json.dumps(
    {"id": "cmpl-bench", "object": "text_completion", "created": 0, "model": MODEL, "choices": [CHOICE], "usage": USAGE}
).encode()
MULTI_TURN_RATE = 100.0  # requests/s of the multi-turn runs (issue 15)
WORDS = (
    "cache",
    "block",
    "router",
    "prefix",
    "token",
    "engine",
    "worker",
    "index",
    "the",
    "a",
    "of",
    "to",
    "and",
    "is",
)
CHATS, MAX_TURNS, SYSTEM_PROMPTS = 16, 9, 4  # conversations at once, turns each, system prompts shared


async def _upstream(port: int) -> web.AppRunner:
    async def completions(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=REPLY, content_type="application/json")

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_get("/health", health)
    return await serve_app(app, port)


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def _conversation(i: int, seed: int) -> list[dict[str, str]]:
    """Request ``i``'s messages: conversation ``i % CHATS`` at turn ``i // CHATS`` (a new
    conversation after ``MAX_TURNS``), each turn ~230 tokens after a ~450-token system prompt
    that ``CHATS / SYSTEM_PROMPTS`` conversations share: 0.5-2.5k tokens in all."""
    chat, turn = i % CHATS, (i // CHATS) % MAX_TURNS
    generation = i // (CHATS * MAX_TURNS)
    system = _words(random.Random(f"{seed}:system:{chat % SYSTEM_PROMPTS}"), 200)
    rng = random.Random(f"{seed}:{generation}:{chat}")
    messages = [{"role": "system", "content": system}]
    for t in range(turn + 1):
        messages.append({"role": "user", "content": _words(rng, 60) + f" ({t}?)"})
        answer = _words(rng, 40)
        if t < turn:
            messages.append({"role": "assistant", "content": answer})
    return messages


def _transcript(messages: list[dict[str, str]]) -> str:
    """A conversation as one completion prompt (plain text: no special tokens)."""
    return "".join(f"{m['role'].capitalize()}: {m['content']}\n\n" for m in messages) + "Assistant:"


def _multi_turn_bodies(kind: str, count: int, seed: int) -> list[bytes]:
    out = []
    for i in range(count):
        messages = _conversation(i, seed)
        body: dict[str, Any] = {"model": MODEL, "max_tokens": 1}
        if kind == "chat":
            body["messages"] = messages
        else:
            body["prompt"] = _transcript(messages)
        out.append(json.dumps(body).encode())
    return out


def cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of ``pids`` and their children so far (Linux /proc), 0 elsewhere."""
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(f) for f in fields[11:13]) / ticks  # utime, stime
        children = Path(f"/proc/{pid}/task/{pid}/children")
        if children.exists():
            total += cpu_s([int(c) for c in children.read_text().split()])
    return total


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


def token_bodies(kind: str, count: int, seed: int = 5) -> list[bytes]:
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


LATENCY_KINDS = ("ids8k", "text2k", "chat", "turns")
SGLANG_KINDS = ("text2k", "chat", "turns")  # its router takes no token ids


AIOHTTP_KINDS = ("ids8k", "text2k")


def _asked_for(kinds: tuple[str, ...], args: argparse.Namespace) -> bool:
    """Whether ``--kinds`` asks for anything of a process measured on ``kinds`` (every process
    has a requests/s run)."""
    return "max_rps" in args.kinds or bool(set(kinds) & set(args.kinds))


async def _measure(
    session: aiohttp.ClientSession,
    name: str,
    url: str,
    direct: str,
    args: argparse.Namespace,
    results: dict[str, Any],
    kinds: tuple[str, ...] = LATENCY_KINDS,
    pids: list[int] | None = None,
) -> None:
    """The latency runs of ``kinds`` (SGLang's router takes no token ids; the pass-through no chats),
    then the most requests/s; ``pids``: the router's processes, whose CPU is read."""
    for kind in (k for k in kinds if k in args.kinds):
        path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        rate = MULTI_TURN_RATE if kind in ("chat", "turns") else args.rate
        warm, bodies = _latency_bodies(kind, args.requests)
        await _open_loop(session, url + path, warm, rate)
        cpu = cpu_s(pids or [])
        routed = await _open_loop(session, url + path, bodies, rate)
        cpu = cpu_s(pids or []) - cpu
        plain = await _open_loop(session, direct + path, bodies, rate)
        results[f"{name}:{kind}"] = {
            "direct_p50_ms": round(1000 * statistics.median(plain), 3),
            "routed_p50_ms": round(1000 * statistics.median(routed), 3),
            "added_p50_ms": round(1000 * (statistics.median(routed) - statistics.median(plain)), 3),
            "added_p99_ms": round(1000 * (percentile(routed, 0.99) - percentile(plain, 0.99)), 3),
            **({"cpu_us": round(1e6 * cpu / len(bodies))} if pids else {}),
        }
    if "max_rps" in args.kinds:
        for text in (False, True) if "ids8k" in kinds else (True,):
            await _max_rps(session, name, url, args, results, text, pids)


def _latency_bodies(kind: str, count: int) -> tuple[list[bytes], list[bytes]]:
    """(warm-up bodies, measured bodies); multi-turn warm-ups are other conversations, so that
    the measured ones find only their own earlier turns remembered."""
    if kind in ("chat", "turns"):
        return _multi_turn_bodies(kind, 50, seed=1), _multi_turn_bodies(kind, count, seed=2)
    bodies = token_bodies(kind, count)
    return bodies[:50], bodies


async def _max_rps(
    session: aiohttp.ClientSession,
    name: str,
    url: str,
    args: argparse.Namespace,
    results: dict[str, Any],
    text: bool,
    pids: list[int] | None = None,
) -> None:
    urls = [url + "/v1/completions"]
    cpu = cpu_s(pids or [])
    done, took = await closed_loop(session, urls, args.seconds, args.concurrency, partial(_short_request, text))
    cpu = cpu_s(pids or []) - cpu
    kind = "text" if text else "ids"
    results[f"{name}:max_rps_{kind}"] = round(done / took, 1)
    if pids and done:
        results[f"{name}:max_rps_{kind}_cpu_us"] = round(1e6 * cpu / done)  # the router's CPU per short request


def _start_router(
    redis_url: str, workers: int = 1, http_server: str = "builtin", upstream_client: str = "builtin"
) -> tuple[subprocess.Popen[bytes], str, str]:
    port = free_port()
    command = [sys.executable, "-m", "router", "--redis-url", redis_url, "--port", str(port)]
    command += ["--tokenizer", f"{MODEL}={TINY_MODEL_DIR}", "--log-level", "WARNING", "--workers", str(workers)]
    command += ["--http-server", http_server, "--upstream-client", upstream_client]
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
                for name, start, ready, kinds in (
                    ("kvroute", partial(_start_router, server.url), "/ready", LATENCY_KINDS),
                    ("kvroute_workers2", partial(_start_router, server.url, 2), "/ready", ()),
                    # the same router on aiohttp's low-level server (issue 56: the design card's aiohttp)
                    ("kvroute_aiohttp", partial(_start_router, server.url, 1, "aiohttp"), "/ready", AIOHTTP_KINDS),
                    # ... and on aiohttp's client to the workers (the built-in server in front)
                    (
                        "kvroute_aiohttp_client",
                        partial(_start_router, server.url, 1, "builtin", "aiohttp"),
                        "/ready",
                        AIOHTTP_KINDS,
                    ),
                    ("passthrough", partial(_start_passthrough, upstream_ports[0]), "/health", ("ids8k", "text2k")),
                ):
                    if not _asked_for(kinds, args):
                        continue
                    process, log, url = start()
                    processes.append(process)
                    logs.append(log)
                    await wait_healthy(session, url + ready, process, log, 30, name=f"the {name} process")
                    if kinds:
                        await _measure(session, name, url, direct, args, results, kinds, [process.pid])
                    elif "max_rps" in args.kinds:  # --workers 2: the most requests/s only
                        await _max_rps(session, name, url, args, results, text=False)
                    stop_processes([process])  # not competing with the next one for the cores
                if args.sglang and _asked_for(SGLANG_KINDS, args):
                    async with SglangRouters([f"http://127.0.0.1:{p}" for p in upstream_ports]) as sglang:
                        await _measure(session, "sglang", sglang.urls[0], direct, args, results, SGLANG_KINDS)
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
