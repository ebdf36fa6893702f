"""``kvroute bench real``: the routing policies on real vLLM engines, the yardstick the simulator answers to.

N real vLLM servers (the CPU build `.ci/vllm-env` installs, the tiny model, block size 32, a KV
cache of ``--cache`` blocks each, ``--max-num-seqs`` running at once), an agent each and the routers
under test; or, with ``--engine sim``, simulated engines of the same sizes and scheduler limits,
whose timing is vLLM's on this machine (``--prefill-ms-per-1k`` ...): the same cells on both are
how the simulator is checked (``--compare``).

A cell fixes the workload (:mod:`kvroute.bench.real_workload`: ids, text, chat), the cache size,
the client and the router replicas. Clients: ``closed``: ``--concurrency`` users, each playing one
conversation at a time, a turn sent when the previous answer came (about one request in flight per
engine: load does not bind); ``open``: arrivals at ``--open-rate`` per second, each to one of the
open conversations (a turn still waits for the previous answer). Every run of a seed sends the same
prompts; the engines' prefix caches are reset before each run and the routers start fresh.

What is judged is the hit rate the engines report (``usage.prompt_tokens_details.cached_tokens`` /
prompt tokens), also as a share of one shared LRU cache of the fleet's size fed the prompts in the
order the run sent them. Latency (whole replies unless ``--stream``) is reported, but engines that
share two cores blur it: an idle engine is no faster than a busy one there.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvindex.settings import RedisSettings
from kvroute.bench.common import cached_tokens, percentile, write_json
from kvroute.bench.lost_split import lost_shares
from kvroute.bench.real_report import render, summarize
from kvroute.bench.real_workload import WORKLOADS, RealWorkload, real_workload
from kvroute.bench.replay import PEERS, router_lost_tokens, router_urls
from kvroute.bench.replay_workload import reference_hit_rates
from kvroute.devstack.embedded_redis import RedisServer
from kvroute.devstack.peers import sglang_python
from kvroute.devstack.stack import MODEL, Stack, StreamedReply, stream_completion, whole_completion
from kvroute.devstack.vllm import BLOCK_SIZE, VllmOptions, vllm_python
from kvservice.lifecycle import StartupError
from kvtokens.tokenizer import ModelPrompts
from router.routing.scoring import Policy
from sim_engine.engine import TimingModel
from sim_engine.settings import TINY_MODEL_DIR

ENGINES = ("vllm", "sim")
CACHES = {"tight": 64, "roomy": 192}  # blocks of 32 tokens per engine: ~2 prompts, the whole workload
CLIENTS = ("closed", "open")
DEFAULT_POLICIES = "kv,prefix,round_robin,least_loaded,sglang"
SGLANG = "sglang"
MAX_MODEL_LEN = 2048  # the tiny model's positions


@dataclass(frozen=True)
class RealCell:
    workload: str
    cache: str
    client: str
    replicas: int

    @property
    def name(self) -> str:
        return f"{self.workload}/{self.cache}/{self.client}/r{self.replicas}"


def cells_from(args: argparse.Namespace) -> list[RealCell]:
    return [
        RealCell(workload, cache, client, replicas)
        for cache in args.caches
        for workload in args.workloads
        for client in args.clients
        for replicas in args.replicas
    ]


# ------------------------------------------------------------------------------------ the clients


async def _one(session: aiohttp.ClientSession, url: str, load: RealWorkload, i: int, stream: bool) -> dict[str, Any]:
    body = {"model": MODEL, **load.body(i, load.requests[i].output_length)}
    sent = time.perf_counter()
    try:
        reply: StreamedReply = await (stream_completion if stream else whole_completion)(session, url, load.path, body)
    except (aiohttp.ClientError, TimeoutError) as exc:
        reply = StreamedReply(599, text=repr(exc))
    usage = reply.usage or {}
    return {
        "index": i,
        "sent": sent,
        "failed": reply.status != 200,
        "latency_s": reply.latency_s,
        "ttft_s": reply.ttft_s if stream else None,
        "prompt_tokens": int(usage.get("prompt_tokens", 0)),
        "cached_tokens": cached_tokens(usage),
        "predicted": reply.predicted_cached_tokens if reply.predicted_known else None,
        "worker": reply.worker,
    }


async def send_closed(
    urls: list[str], load: RealWorkload, concurrency: int, stream: bool, think_s: float, seed: int
) -> list[dict[str, Any]]:
    """``concurrency`` users, each playing its next conversation turn after turn (replicas in
    turn), thinking a while before each turn (exponential, mean ``think_s``, fixed per request
    and seed): users that never think stay in lockstep, and a round robin then pins each one to
    an engine by chance of timing."""
    results: list[dict[str, Any]] = []
    queue = iter(load.conversations)
    async with _session() as session:

        async def user(number: int) -> None:
            for conversation in queue:
                for i in conversation:
                    if think_s > 0:
                        await asyncio.sleep(random.Random(f"real/think/{seed}/{i}").expovariate(1 / think_s))
                    results.append(await _one(session, urls[i % len(urls)], load, i, stream))

        await asyncio.gather(*(user(n) for n in range(concurrency)))
    return results


async def send_open(urls: list[str], load: RealWorkload, rate: float, seed: int, stream: bool) -> list[dict[str, Any]]:
    """Poisson arrivals at ``rate`` per second in the workload's order; a turn waits for the previous answer."""
    results: list[dict[str, Any]] = []
    answered = [asyncio.Event() for _ in load.requests]
    gaps = random.Random(f"real/arrivals/{seed}")
    due, at = [], 0.0
    for _ in load.requests:
        at += gaps.expovariate(rate)
        due.append(at)
    start = time.perf_counter()
    async with _session() as session:

        async def arrive(i: int) -> None:
            await asyncio.sleep(max(0.0, start + due[i] - time.perf_counter()))
            if (previous := load.after[i]) is not None:
                await answered[previous].wait()
            try:
                results.append(await _one(session, urls[i % len(urls)], load, i, stream))
            finally:
                answered[i].set()

        await asyncio.gather(*(arrive(i) for i in range(len(load.requests))))
    return results


def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=300))


# --------------------------------------------------------------------------------------- a run


def run_figures(results: list[dict[str, Any]], load: RealWorkload, per_engine: list[int], capacity: int) -> dict:
    """A run's row: the engines' hit rate, of the shared-LRU reference fed in the run's send order,
    each engine's requests, latency, and how often the router's prediction was exact."""
    done = [r for r in results if not r["failed"]]
    prompt = sum(r["prompt_tokens"] for r in done)
    hit = sum(r["cached_tokens"] for r in done) / max(prompt, 1)
    order = [load.requests[r["index"]] for r in sorted(results, key=lambda r: r["sent"])]
    lru, _ = reference_hit_rates(order, capacity, BLOCK_SIZE)
    latencies = sorted(1000 * r["latency_s"] for r in done) or [0.0]
    ttfts = [1000 * r["ttft_s"] for r in done if r["ttft_s"]]
    predicted = [r for r in done if r["predicted"] is not None]
    mean = sum(per_engine) / max(len(per_engine), 1)
    return {
        "hit_rate": round(hit, 4),
        "lru_reference": round(lru, 4),
        "of_lru": round(hit / max(lru, 1e-9), 4),
        "requests": len(results),
        "failed": len(results) - len(done),
        "per_engine": per_engine,
        "busiest_vs_mean": round(max(per_engine, default=0) / max(mean, 1e-9), 3),
        "latency_mean_ms": round(statistics.mean(latencies), 2),
        "latency_p90_ms": round(percentile(latencies, 0.9), 2),
        "ttft_mean_ms": round(statistics.mean(ttfts), 2) if ttfts else None,
        "prediction_exact": round(sum(r["predicted"] == r["cached_tokens"] for r in predicted) / len(predicted), 4)
        if predicted
        else None,
    }


async def run_policy(stack: Stack, cell: RealCell, policy: str, load: RealWorkload, args: argparse.Namespace) -> dict:
    await stack.reset_caches(forget_learned=not args.keep_learned)
    before = await stack.requests_per_engine()
    started = time.perf_counter()
    # The SGLang router's health checks marked CPU engines under load down and failed requests
    # (12 of 96 in issue 55's runs, 29 of 128 in one here): off, as in issue 55's figures.
    async with router_urls(stack, policy, cell.replicas, ("--disable-health-check",)) as urls:
        if cell.client == "closed":
            results = await send_closed(urls, load, args.concurrency, args.stream, args.think_ms / 1000, args.seed)
        else:
            results = await send_open(urls, load, args.open_rate, args.seed, args.stream)
        lost = await router_lost_tokens(urls) if policy not in PEERS else None
        learned = await _learned(urls[0]) if policy not in PEERS else None
    seconds = time.perf_counter() - started
    per_engine = [b - a for a, b in zip(before, await stack.requests_per_engine(), strict=True)]
    capacity = stack.engines * (stack.num_blocks - 1)  # the null block holds nothing
    row = {"policy": policy, **run_figures(results, load, [int(n) for n in per_engine], capacity)}
    row |= {"lost_share": lost_shares(lost), "seconds": round(seconds, 1), "learned": learned}
    # each request in send order: index, tenant, worker, predicted and reported cached tokens, prompt
    ordered = sorted(results, key=lambda r: r["sent"])
    row["sent"] = [
        [r["index"], load.tenants[r["index"]], r["worker"], r["predicted"], r["cached_tokens"], r["prompt_tokens"]]
        for r in ordered
    ]
    return row


async def _learned(url: str) -> dict[str, Any] | None:
    """What a kvroute replica learned of the engines by the end of a run (``GET /debug/model``)."""
    async with _session() as session, session.get(f"{url}/debug/model", params={"model": MODEL}) as response:
        return await response.json() if response.status == 200 else None


def _options(args: argparse.Namespace, blocks: int) -> dict[str, Any]:
    """The Stack's keywords for engines of ``blocks`` blocks: real vLLM or the simulated engine."""
    # vLLM refuses a model length its cache cannot hold once (block 0 is the null block)
    max_model_len = min(MAX_MODEL_LEN, (blocks - 1) * BLOCK_SIZE)
    if args.engine == "vllm":
        limits = {"max_model_len": max_model_len, "max_num_seqs": args.max_num_seqs}
        options = VllmOptions(num_blocks=blocks, spread_cores=args.spread_cores, **limits)
        return {"vllm": options}
    timing = TimingModel(
        prefill_ms_per_1k_tokens=args.prefill_ms_per_1k,
        decode_ms_per_step=args.decode_ms_per_step,
        step_overhead_ms=args.step_overhead_ms,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    sizes = {"num_blocks": blocks, "block_size": BLOCK_SIZE, "max_model_len": max_model_len}
    return {**sizes, "timing": timing, "shared_cores": args.sim_shared_cores}


async def run_grid(args: argparse.Namespace) -> list[dict[str, Any]]:
    prompts = ModelPrompts(TINY_MODEL_DIR)
    cells = cells_from(args)
    out = []
    with RedisServer() as server:
        for number, cache in enumerate(args.caches):
            blocks = args.cache_blocks[cache]
            redis = RedisSettings(url=server.url, prefix=f"real{number}")
            print(f"{args.engines} {args.engine} engines of {blocks} blocks ({cache})", file=sys.stderr)
            async with Stack(redis, engines=args.engines, **_options(args, blocks)) as stack:
                for cell in (c for c in cells if c.cache == cache):
                    out += await _run_cell(stack, cell, prompts, args)
    return out


async def _run_cell(stack: Stack, cell: RealCell, prompts: ModelPrompts, args: argparse.Namespace) -> list[dict]:
    out = []
    for seed in args.seeds:
        load = real_workload(cell.workload, seed, prompts, BLOCK_SIZE)
        runs = []
        for policy in args.policies:
            if policy == SGLANG and cell.workload == "ids":
                continue  # the SGLang router routes text
            print(f"  {cell.name} seed {seed}: {policy}", file=sys.stderr)
            run_args = argparse.Namespace(**{**vars(args), "seed": seed})
            runs.append(await run_policy(stack, cell, policy, load, run_args))
        out.append(
            {
                "cell": cell.name,
                "workload": cell.workload,
                "cache": cell.cache,
                "client": cell.client,
                "replicas": cell.replicas,
                "seed": seed,
                "engine_blocks": stack.num_blocks,
                "mean_prompt_tokens": round(load.mean_prompt_tokens, 1),
                "distinct_blocks": load.distinct_blocks,
                "runs": runs,
            }
        )
    return out


# ------------------------------------------------------------------------------------ arguments


def check_args(args: argparse.Namespace) -> None:
    """Combinations argparse cannot check, and what the engines need: a :class:`StartupError`."""
    for name, values, known in (
        ("--workloads", args.workloads, WORKLOADS),
        ("--clients", args.clients, CLIENTS),
        ("--caches", args.caches, tuple(args.cache_blocks)),
    ):
        if unknown := [v for v in values if v not in known]:
            raise StartupError(f"unknown {name} value {unknown[0]!r}: choose from {', '.join(known)}")
    policies = [p.value for p in Policy] + [SGLANG]
    if unknown := [p for p in args.policies if p not in policies]:
        raise StartupError(f"unknown policy {unknown[0]!r} in --policies: choose from {', '.join(policies)}")
    if SGLANG in args.policies and not _has_sglang_router():
        print(f"note: no sglang column: sglang-router is not importable by {sglang_python()}", file=sys.stderr)
        args.policies = [p for p in args.policies if p != SGLANG]
    if args.engine == "vllm":
        vllm_python()  # a missing environment is said before anything starts


def _has_sglang_router() -> bool:
    import subprocess

    done = subprocess.run([sglang_python(), "-c", "import sglang_router"], capture_output=True, check=False)
    return done.returncode == 0


def run_from_args(args: argparse.Namespace) -> int:
    if args.compare:
        from kvroute.bench.real_report import compare_files

        print(compare_files(args.compare[0], args.compare[1]))
        return 0
    check_args(args)
    cells = asyncio.run(run_grid(args))
    report = {"settings": _settings(args), "cells": cells, "summary": summarize(cells)}
    print(render(report))
    if args.json:
        write_json(args.json, report, "results")
    return 0


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    keys = ["engine", "engines", "max_num_seqs", "concurrency", "think_ms", "open_rate", "stream", "seeds"]
    keys += ["policies", "spread_cores", "keep_learned"]
    sim = ("prefill_ms_per_1k", "decode_ms_per_step", "step_overhead_ms", "max_num_batched_tokens", "sim_shared_cores")
    return {k: getattr(args, k) for k in (*keys, *(sim if args.engine == "sim" else ()))} | {
        "cache_blocks": {c: args.cache_blocks[c] for c in args.caches},
        "block_size": BLOCK_SIZE,
    }
