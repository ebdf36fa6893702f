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
from typing import Any

import aiohttp

from kvroute.bench.common import closed_loop, print_fields
from kvroute.devstack.embedded_redis import free_port
from kvroute.devstack.processes import remove_files, start_logged, stop_processes, wait_healthy

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


def _prompt(i: int, n: int) -> dict[str, Any]:
    """Client ``i``'s ``n``-th request: a shared 64-token prefix, then a unique tail."""
    return {"model": "tiny", "prompt": [*range(10, 74), i, n % 50], "max_tokens": 8}


def _start_engine(port: int, speedup: float) -> tuple[subprocess.Popen[bytes], str]:
    command = [sys.executable, "-m", "kvroute", "sim-engine", "--port", str(port)]
    command += ["--events-endpoint", f"tcp://*:{free_port()}", "--replay-endpoint", f"tcp://*:{free_port()}"]
    command += ["--speedup", str(speedup)]
    return start_logged(command, "bench-sim")


async def run_benchmark(args: argparse.Namespace) -> dict[str, float]:
    ports = [free_port() for _ in range(args.engines)]
    started_engines = [_start_engine(port, args.speedup) for port in ports]
    processes = [process for process, _ in started_engines]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            started = time.monotonic()
            await asyncio.gather(
                *(
                    wait_healthy(session, url + "/health", p, log)
                    for url, (p, log) in zip(urls, started_engines, strict=True)
                )
            )
            startup = time.monotonic() - started
            await asyncio.sleep(2.0)  # settle: start-up work is not idle CPU
            cpu_before = sum(_cpu_seconds(p.pid) for p in processes)
            await asyncio.sleep(args.idle_seconds)  # the idle window measured
            idle_cpu = (sum(_cpu_seconds(p.pid) for p in processes) - cpu_before) / args.idle_seconds
            rss = sum(_rss_bytes(p.pid) for p in processes)
            completions = [url + "/v1/completions" for url in urls]
            served, _ = await closed_loop(session, completions, args.load_seconds, args.concurrency, _prompt)
    finally:
        stop_processes(processes)
        remove_files(log for _, log in started_engines)
    return {
        "engines": args.engines,
        "startup_s_all": round(startup, 2),
        "rss_mib_total": round(rss / 2**20, 1),
        "rss_mib_per_engine": round(rss / 2**20 / args.engines, 1),
        "idle_cpu_cores_total": round(idle_cpu, 4),
        "requests_per_s_total": round(served / args.load_seconds, 1),
    }


def run_from_args(args: argparse.Namespace) -> int:
    print_fields(asyncio.run(run_benchmark(args)))
    return 0
