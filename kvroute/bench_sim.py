"""``kvroute bench sim``: what N simulated engines cost on this machine.

Starts N ``kvroute sim-engine`` processes (KV events and replay on), then measures their total
resident memory, their CPU use while idle, and the requests/s they serve together under load
(short prompts sharing a prefix, at ``--speedup``), from /proc.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

import aiohttp

from kvroute.embedded_redis import free_port

TICKS = os.sysconf("SC_CLK_TCK")


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


async def _wait_up(session: aiohttp.ClientSession, url: str, within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            async with session.get(url + "/health") as response:
                if response.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} did not come up within {within} s")


async def _load(session: aiohttp.ClientSession, urls: list[str], seconds: float, concurrency: int) -> int:
    done = 0
    deadline = time.monotonic() + seconds

    async def client(i: int) -> None:
        nonlocal done
        url = urls[i % len(urls)] + "/v1/completions"
        n = 0
        while time.monotonic() < deadline:
            prompt = [*range(10, 74), i, n % 50]  # a shared 64-token prefix, then a unique tail
            async with session.post(url, json={"model": "tiny", "prompt": prompt, "max_tokens": 8}) as response:
                await response.read()
                done += response.status == 200
            n += 1

    await asyncio.gather(*(client(i) for i in range(concurrency)))
    return done


def _start_engine(port: int, speedup: float) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "kvroute", "sim-engine", "--port", str(port),
               "--events-endpoint", f"tcp://*:{free_port()}", "--replay-endpoint", f"tcp://*:{free_port()}",
               "--speedup", str(speedup)]  # fmt: skip
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def run_benchmark(args: argparse.Namespace) -> dict[str, float]:
    ports = [free_port() for _ in range(args.engines)]
    processes = [_start_engine(port, args.speedup) for port in ports]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            started = time.monotonic()
            await asyncio.gather(*(_wait_up(session, url) for url in urls))
            startup = time.monotonic() - started
            await asyncio.sleep(2.0)  # settle
            cpu_before = sum(_cpu_seconds(p.pid) for p in processes)
            await asyncio.sleep(args.idle_seconds)
            idle_cpu = (sum(_cpu_seconds(p.pid) for p in processes) - cpu_before) / args.idle_seconds
            rss = sum(_rss_bytes(p.pid) for p in processes)
            served = await _load(session, urls, args.load_seconds, args.concurrency)
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(10)
    return {
        "engines": args.engines,
        "startup_s_all": round(startup, 2),
        "rss_mib_total": round(rss / 2**20, 1),
        "rss_mib_per_engine": round(rss / 2**20 / args.engines, 1),
        "idle_cpu_cores_total": round(idle_cpu, 4),
        "requests_per_s_total": round(served / args.load_seconds, 1),
    }


def run_from_args(args: argparse.Namespace) -> int:
    results = asyncio.run(run_benchmark(args))
    width = max(len(k) for k in results)
    for key, value in results.items():
        print(f"{key.ljust(width)}  {value}")
    return 0
