"""``kvroute bench soak``: the whole stack under a steady load for N minutes, memory sampled.

Starts a private Redis, ``--engines`` simulated engines (default 8) with an agent each and
``--routers`` router replicas (default 2, policy kv), each a process of its own (the development
stack, :class:`kvroute.devstack.stack.Stack`), then sends multi-turn chats through the routers at
``--rate`` requests per second (:mod:`kvroute.bench.soak_load`) for ``--minutes``. Every
``--sample-seconds`` it reads every process's resident memory (RSS, its child processes
included) from /proc, and Redis's ``used_memory``; a process that exits ends the run (exit status
1, with the end of its log). At the end it reads each agent's and router's error counters from
their /metrics.

The run passes (exit status 0, else 1) when
* no request failed (an answer other than 200, a connection error or timeout, a stream that ended
  without its last event);
* no agent counter in :data:`AGENT_ERRORS` and no router counter in :data:`ROUTER_ERRORS` is above 0
  (the recoveries, :data:`AGENT_RECOVERIES` and :data:`ROUTER_RECOVERIES`, are reported only);
* no process's RSS grew by more than ``--max-growth-mib`` over the measured window. The first
  ``--warmup`` of the run (default: half) is warm-up: the engines' caches fill and start evicting,
  the index in Redis grows to the size of those caches, the routers' caches and the allocators'
  pools fill. Growth is the median of the last three samples minus the median of the first three
  after the warm-up (medians, so that one sample taken in a burst does not decide). The default
  bound, 16 MiB per process, is about five times the largest second-half growth of a healthy
  10-minute run at the defaults (2.9 MiB, a router; engines 1.5, agents 0.5, Redis 0.1:
  docs/reliability.md), and what a leak of about 11 KiB per request reaches in one router (each
  serves about 1,500 requests in the second half). A router's bounded caches are still filling
  then (its prefix-hash memo, up to 16,384 segments, gains ~4,000 in 6,000 requests of this load),
  so a small steady router growth in a 10-minute run is expected (a longer run shows whether it
  levels off).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvindex.settings import RedisSettings
from kvroute.bench.common import text_table, write_json
from kvroute.bench.soak_load import ChatLoad
from kvroute.devstack.embedded_redis import RedisServer
from kvroute.devstack.stack import Child, Stack
from kvservice.lifecycle import StartupError
from kvservice.metrics_page import read_metrics
from router.routing.scoring import Policy
from sim_engine.engine import TimingModel

KINDS = ("redis", "engine", "agent", "router")
AGENT_ERRORS = (
    "decode_errors",
    "redis_errors",
    "internal_errors",
    "engine_restarts",
    "engine_down",
    "resyncs",
    "replays_incomplete",
    "wrong_topic",
    "engine_metric_errors",
)
ROUTER_ERRORS = ("upstream_errors", "requests_5xx")
# Reported, not errors: the stack's own recovery, which no client sees. A degraded decision is one
# made without the index (Redis did not answer within the router's time budget: a loaded machine).
AGENT_RECOVERIES = ("gaps", "replays", "duplicates")
ROUTER_RECOVERIES = ("upstream_retries", "degraded_decisions")
MIB = 2**20


class SoakStack(Stack):
    """The development stack, noting every process it starts (name, kind) and giving each agent a
    metrics port, so that the soak can sample their memory and read the agents' error counters."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.children: list[tuple[str, Child]] = []  # (kind, child)
        self.agent_metrics: list[str] = []  # base URLs of the agents' /metrics

    def _start(self, name: str, command: list[str]) -> Child:
        kind = {"simulated": "engine", "agent": "agent", "router": "router"}[name.split()[0]]
        if kind == "agent":
            port = self._port()
            command = [*command, "--metrics-port", str(port), "--metrics-host", "127.0.0.1"]
            self.agent_metrics.append(f"http://127.0.0.1:{port}")
        child = super()._start(name, command)
        self.children.append((kind, child))
        return child


# ---------------------------------------------------------------------------------------- memory


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process now (one pass over /proc)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    parents[int(entry)] = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue  # it exited meanwhile
    return parents


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree_rss_bytes(pid: int, parents: dict[int, int]) -> int:
    """RSS of ``pid`` and of every process below it (a router's or engine's helper processes)."""
    children: dict[int, list[int]] = {}
    for child, parent in parents.items():
        children.setdefault(parent, []).append(child)
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        total += _rss_bytes(current)
        todo += children.get(current, [])
    return total


@dataclass
class Process:
    name: str  # "redis", "simulated engine 3", "agent of simulated engine 3", "router replica 1"
    kind: str
    pid: int


@dataclass
class Samples:
    processes: list[Process]
    times_s: list[float] = field(default_factory=list)
    rss_mib: dict[str, list[float]] = field(default_factory=dict)  # by process name
    redis_used_memory_mib: list[float] = field(default_factory=list)
    requests_ok: list[int] = field(default_factory=list)

    def take(self, t: float, used_memory: int, requests_ok: int) -> None:
        parents = _parents()
        self.times_s.append(round(t, 2))
        for process in self.processes:
            rss = tree_rss_bytes(process.pid, parents) / MIB
            self.rss_mib.setdefault(process.name, []).append(round(rss, 2))
        self.redis_used_memory_mib.append(round(used_memory / MIB, 2))
        self.requests_ok.append(requests_ok)

    def growth_mib(self, name: str, warmup: float) -> float:
        """Median of the last three samples minus the median of the first three after the warm-up."""
        end = self.times_s[-1]
        window = [v for t, v in zip(self.times_s, self.rss_mib[name], strict=True) if t >= warmup * end]
        if len(window) < 2:
            window = self.rss_mib[name][-2:]
        edge = max(1, min(3, len(window) // 2))
        return round(statistics.median(window[-edge:]) - statistics.median(window[:edge]), 2)


async def sample_until(stack: SoakStack, server: RedisServer, samples: Samples, load: ChatLoad, every_s: float) -> None:
    """Sample every ``every_s`` until cancelled; a process of the stack that exits ends the run."""
    client = RedisSettings(url=server.url).client()
    started = time.perf_counter()
    try:
        while True:
            for _, child in stack.children:
                if (failure := child.failure()) is not None:
                    raise failure
            used = int((await client.info("memory"))["used_memory"])
            samples.take(time.perf_counter() - started, used, load.stats.ok)
            await asyncio.sleep(every_s)  # the sampling period, not a synchronisation
    finally:
        await client.aclose()


# ------------------------------------------------------------------------------------- counters


async def counters(session: aiohttp.ClientSession, base_url: str, prefix: str) -> dict[str, float]:
    """Every counter on ``base_url``/metrics named ``prefix...``, summed over labels, without the
    prefix and ``_total``; ``requests_5xx``: requests answered with a 5xx status."""
    page = await read_metrics(session, base_url + "/metrics")
    totals: dict[str, float] = {}
    for sample in page.samples:
        if sample.name.startswith(prefix) and sample.name.endswith("_total"):
            name = sample.name[len(prefix) : -len("_total")]
            totals[name] = totals.get(name, 0.0) + sample.value
    five_xx = page.by_label(prefix + "requests_total", "status", lambda s: s.labels["status"].startswith("5"))
    if five_xx:
        totals["requests_5xx"] = sum(five_xx.values())
    return totals


async def fleet_counters(stack: SoakStack, router_urls: list[str]) -> dict[str, dict[str, int]]:
    """The agents' and the routers' counters, each summed over its kind's processes."""
    out: dict[str, dict[str, int]] = {"agent": {}, "router": {}}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        kinds = (("agent", stack.agent_metrics, "kvroute_agent_"), ("router", router_urls, "kvroute_router_"))
        for kind, urls, prefix in kinds:
            for url in urls:
                for name, value in (await counters(session, url, prefix)).items():
                    out[kind][name] = out[kind].get(name, 0) + int(value)
    return out


# -------------------------------------------------------------------------------------- the run


async def run_soak(args: argparse.Namespace) -> dict[str, Any]:
    timing = TimingModel(prefill_ms_per_1k_tokens=100, decode_ms_per_step=5, step_overhead_ms=1)
    seconds = args.minutes * 60
    with RedisServer() as server:
        redis = RedisSettings(url=server.url)
        stack = SoakStack(redis, engines=args.engines, num_blocks=args.num_blocks, timing=timing)
        async with stack:
            urls = await stack.start_routers(Policy.KV, replicas=args.routers)
            processes = [Process("redis", "redis", server.process.pid if server.process else 0)]
            processes += [Process(child.name, kind, child.process.pid) for kind, child in stack.children]
            samples = Samples(processes)
            load = ChatLoad(urls, args.rate)
            print(f"soak: {len(processes)} processes, {args.rate:g} requests/s for {seconds:g} s", file=sys.stderr)
            started = time.perf_counter()
            await load_while_sampling(load, seconds, sample_until(stack, server, samples, load, args.sample_seconds))
            elapsed = time.perf_counter() - started
            await final_sample(server, samples, load, elapsed)
            fleet = await fleet_counters(stack, urls)
    return report(args, samples, load, fleet, elapsed)


async def load_while_sampling(load: ChatLoad, seconds: float, sampling: Coroutine[Any, Any, None]) -> None:
    """Run the load for ``seconds`` while ``sampling`` runs; the sampler's failure (a process
    exited) ends both."""
    tasks = [asyncio.create_task(sampling), asyncio.create_task(load.run(seconds))]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()  # ProcessFailed from the sampler, or the load's own error
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def final_sample(server: RedisServer, samples: Samples, load: ChatLoad, t: float) -> None:
    """The last sample, once the load has ended."""
    client = RedisSettings(url=server.url).client()
    try:
        samples.take(t, int((await client.info("memory"))["used_memory"]), load.stats.ok)
    finally:
        await client.aclose()


def report(
    args: argparse.Namespace, samples: Samples, load: ChatLoad, fleet: dict[str, dict[str, int]], elapsed: float
) -> dict[str, Any]:
    growth = {p.name: samples.growth_mib(p.name, args.warmup) for p in samples.processes}
    errors = {f"agent {k}": fleet["agent"].get(k, 0) for k in AGENT_ERRORS}
    errors |= {f"router {k}": fleet["router"].get(k, 0) for k in ROUTER_ERRORS}
    requests = load.stats.summary(elapsed)
    over = sorted(name for name, g in growth.items() if g > args.max_growth_mib)
    problems = [f"{requests['failed']} requests failed"] if requests["failed"] else []
    problems += [f"{name} = {value}" for name, value in errors.items() if value]
    problems += [f"RSS of {name} grew {growth[name]:+.1f} MiB (bound {args.max_growth_mib:g})" for name in over]
    return {
        "settings": {k: getattr(args, k) for k in ("minutes", "rate", "engines", "routers", "num_blocks")}
        | {"sample_seconds": args.sample_seconds, "warmup": args.warmup, "max_growth_mib": args.max_growth_mib},
        "seconds": round(elapsed, 1),
        "conversations": load.conversations,
        "requests": requests,
        "errors": errors,
        "recoveries": {f"agent {k}": fleet["agent"].get(k, 0) for k in AGENT_RECOVERIES}
        | {f"router {k}": fleet["router"].get(k, 0) for k in ROUTER_RECOVERIES},
        "rss_growth_mib": growth,
        "summary": kind_summary(samples, growth),
        "processes": [vars(p) for p in samples.processes],
        "samples": {
            "t_s": samples.times_s,
            "rss_mib": samples.rss_mib,
            "redis_used_memory_mib": samples.redis_used_memory_mib,
            "requests_ok": samples.requests_ok,
        },
        "passed": not problems,
        "problems": problems,
    }


def kind_summary(samples: Samples, growth: dict[str, float]) -> list[dict[str, Any]]:
    """Per kind of process: mean RSS per process at the start and the end, the largest RSS seen,
    and the largest growth over the measured window (with the process it was seen in)."""
    rows = []
    for kind in KINDS:
        names = [p.name for p in samples.processes if p.kind == kind]
        if not names:
            continue
        worst = max(names, key=lambda n: growth[n])
        rows.append(
            {
                "kind": kind,
                "processes": len(names),
                "start_mib": round(statistics.mean(samples.rss_mib[n][0] for n in names), 1),
                "max_mib": round(max(max(samples.rss_mib[n]) for n in names), 1),
                "end_mib": round(statistics.mean(samples.rss_mib[n][-1] for n in names), 1),
                "growth_mib": growth[worst],
                "growth_in": worst,
            }
        )
    return rows


def render(result: dict[str, Any]) -> str:
    s, r = result["settings"], result["requests"]
    headers = ["process", "n", "RSS start MiB", "RSS max MiB", "RSS end MiB", "growth MiB", "worst"]
    rows = [
        [
            k["kind"],
            k["processes"],
            k["start_mib"],
            k["max_mib"],
            k["end_mib"],
            f"{k['growth_mib']:+.1f}",
            k["growth_in"],
        ]
        for k in result["summary"]
    ]
    used = result["samples"]["redis_used_memory_mib"]
    lines = [
        f"{result['seconds']:g} s, {s['engines']} engines, {s['routers']} routers, {r['sent']} requests "
        f"({r['requests_per_s']:g}/s) in {result['conversations']} conversations",
        f"RSS per process (start, end: mean of the kind; max: largest; growth: over the last "
        f"{1 - s['warmup']:.0%} of the run, worst process of the kind; bound {s['max_growth_mib']:g} MiB)",
        text_table(headers, rows),
        f"Redis used_memory: {used[0]:.1f} MiB at the start, {max(used):.1f} max, {used[-1]:.1f} at the end",
        f"requests: {r['ok']} ok, {r['failed']} failed {r['failures'] or ''}; "
        f"TTFT mean {r['ttft_mean_ms']:g} ms, p99 {r['ttft_p99_ms']:g} ms",
        "errors: " + ", ".join(f"{k} {v}" for k, v in result["errors"].items()),
        "recoveries (not errors): " + ", ".join(f"{k} {v}" for k, v in result["recoveries"].items()),
    ]
    lines += [f"  {example}" for example in r["failure_examples"]]
    lines.append("PASSED" if result["passed"] else "FAILED: " + "; ".join(result["problems"]))
    return "\n".join(lines)


def run_from_args(args: argparse.Namespace) -> int:
    if not 0 <= args.warmup < 1:
        raise StartupError(f"--warmup must be a fraction in [0, 1), got {args.warmup}")
    result = asyncio.run(run_soak(args))
    print(render(result))
    if args.json:
        write_json(args.json, result, "samples")
    return 0 if result["passed"] else 1
