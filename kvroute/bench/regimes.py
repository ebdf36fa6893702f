"""``kvroute bench regimes``: every policy on a grid of regimes, each judged against the best in its cell.

A cell fixes one value of each axis (:mod:`kvroute.bench.regimes_workload`: tenants, load, cache,
client, prompts, router replicas). Its requests are generated once and replayed through each
policy by ``bench replay``'s loop (:func:`kvroute.bench.replay.replay_on_stack`: empty engine
caches first, open loop at the arrival times, a conversation's turn held until the previous turn's
reply) on a stack of simulated engines sized for the cell: their caches together hold the cache
axis's fraction of the cell's distinct blocks, their clock runs ``--wall-rate / arrival rate``
times faster than real time (every run sends about ``--wall-rate`` requests per wall second, so
the machine is equally busy in every cell), and each has vLLM's per-step token budget and batch
limit. Cells that differ only in client, prompts or replicas share one stack.

Times are reported in the engines' clock (wall ms x the cell's time scale), comparable across
cells. Streamed cells report time to first token as the client sees it; non-streamed cells
(``client=nostream``) report the time to the whole reply ("latency"): a non-streaming client sees
nothing earlier. The engines' own TTFT histogram (vllm:time_to_first_token_seconds, whose mean
is exact from its sum and count) is in the JSON for every run as ``engine_ttft_mean_ms``.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import itertools
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvindex.settings import RedisSettings
from kvroute import charts
from kvroute.bench.common import percentile, write_json
from kvroute.bench.regimes_report import across_seeds, relative_to_best, render, summarize_policies
from kvroute.bench.regimes_workload import (
    CACHE,
    CPU_LOAD_SHARE,
    DISK_LOAD_SHARE,
    PD_OUTPUT_TOKENS,
    TIERED_CACHE,
    TINY_PROMPTS,
    Cell,
    Workload,
    grid,
    pd_roles,
    workload,
)
from kvroute.bench.replay import GREEDY_ORACLE, ROUTER_VARIANTS, fleet_capacity, prompts_for, replay_on_stack
from kvroute.bench.replay_workload import reference_hit_rates
from kvroute.devstack.embedded_redis import RedisServer
from kvroute.devstack.stack import Stack
from kvservice.lifecycle import StartupError
from kvtokens.tokenizer import ModelPrompts
from router.routing.scoring import Policy
from sim_engine.engine import TimingModel
from sim_engine.settings import TINY_MODEL_DIR

SGLANG = "sglang"
DEFAULT_POLICIES = "kv,round_robin,least_loaded,prefix,greedy_oracle,sglang"
DEFAULT_SEEDS = (1, 2, 3, 4)  # one run of a tight cell can be off by 2x: a cell is judged over seeds
HELD_S = 0.001  # a turn sent this much past its arrival time waited for the previous reply
# prefill=parallel: each request's chunk per step (its own lane), so that a request that arrives
# while another's long prefill runs waits at most one short step, not the whole prefill
PARALLEL_CHUNK_TOKENS = 256
# Routers whose run does not depend on the replica count: run once per cell and seed, shared by
# the cells that differ only in replicas (the oracle is one process that knows everything).
REPLICA_FREE = (GREEDY_ORACLE,)


def policies_from(flag: str) -> list[str]:
    known = [p.value for p in Policy] + [*ROUTER_VARIANTS, GREEDY_ORACLE, SGLANG]
    policies = list(dict.fromkeys(p.strip() for p in flag.split(",") if p.strip()))
    for policy in policies:
        if policy not in known:
            raise StartupError(f"unknown policy {policy!r} in --policies: choose from {', '.join(known)}")
    if not policies:
        raise StartupError("--policies lists no policy")
    return policies


def cell_policies(cell: Cell, policies: list[str]) -> list[str]:
    """The SGLang router takes text only: it runs on text cells."""
    return [p for p in policies if p != SGLANG or cell.prompts == "text"]


# ------------------------------------------------------------------------------------- running


def _timing(args: argparse.Namespace, speedup: float, cell: Cell | None = None) -> TimingModel:
    limits: dict[str, Any] = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens}
    parameters = inspect.signature(TimingModel).parameters
    if "max_num_batched_tokens" not in parameters:
        limits = {"max_running": args.max_num_seqs}  # a simulated engine from before the token budget
    if "parallel_prefill" in parameters:  # a simulated engine from before these has neither
        limits["parallel_prefill"] = cell is not None and cell.prefill == "parallel"
        limits["prefill_context_ns"] = getattr(args, "prefill_context_ns", 0.0)
        if limits["parallel_prefill"]:
            limits["max_num_batched_tokens"] = PARALLEL_CHUNK_TOKENS
    return TimingModel(
        prefill_ms_per_1k_tokens=args.prefill_ms_per_1k,
        decode_ms_per_step=args.decode_ms_per_step,
        step_overhead_ms=1.0,
        speedup=speedup,
        **limits,
    )


def _run_figures(run: Any, results: list[dict[str, Any]], time_scale: float) -> dict[str, Any]:
    """A run's row: times in the engines' clock (wall x time scale)."""
    return {
        "policy": run.router,
        "replicas": run.replicas,
        "ttft_mean_ms": round(run.ttft_mean_ms * time_scale, 2),
        "ttft_p90_ms": round(percentile(run.ttft_ms, 0.9) * time_scale, 2),
        # the mean inter-token latency of the streamed replies (None: not streamed)
        "itl_mean_ms": None if run.itl_mean_ms is None else round(run.itl_mean_ms * time_scale, 3),
        "split_share": run.split_share,  # of the requests, those split (a prefill/decode fleet's)
        "hit_rate": round(run.hit_rate, 4),
        "of_lru": round(run.of_lru_reference, 4),
        "failed": run.failed,
        "requests": run.requests,
        "engine_ttft_mean_ms": round(run.engine_ttft_mean_ms * time_scale, 2),
        "busiest_worker_vs_mean": round(run.busiest_worker_vs_mean, 3),
        "held_turns": sum(1 for r in results if r.get("held_s", 0) > HELD_S),
        # lost prefix tokens by reason (load / stale / cold) as shares of the cacheable tokens;
        # None for the SGLang router, which counts none
        "lost_share": run.lost_share,
        "degraded_share": run.degraded_share,  # decisions made without Redis, of all (None: a peer)
        # predicted cached tokens == the engine's, of the requests (None: a router that predicts none)
        "prediction_exact": run.prediction_exact,
        # with --probe: best / choice_loss / schedule_loss at the sends (kvroute.bench.probe); else None
        "probe": run.probe_split,
    }


@dataclass
class _Engines:
    """What the cells of one engine setting share: the stack, its sizes and the cell's workload."""

    stack: Stack
    load: Workload
    capacity: int  # the fleet's cache in the workload's blocks (the LRU reference's size)
    engine_kv_tokens: int
    time_scale: float
    replica_free: dict[tuple[str, str, str], dict[str, Any]]  # (policy, client, prompts) -> its run


def _prompts(cell: Cell, load: Workload) -> list[Any]:
    """What the client sends: a prose workload's text, or its token ids as the engine computes them."""
    if load.texts is None:
        return prompts_for(load.requests, cell.prompts == "text")
    if cell.prompts == "text":
        return list(load.texts)
    prompts = ModelPrompts(TINY_MODEL_DIR)
    return [prompts.encode(text, add_special_tokens=True) for text in load.texts]


async def _run_cell(engines: _Engines, cell: Cell, policies: list[str], args: Any) -> dict[str, Any]:
    load, capacity, time_scale = engines.load, engines.capacity, engines.time_scale
    requests = load.requests
    lru, infinite = reference_hit_rates(requests, capacity, load.block_tokens)
    distinct = len({h for r in requests for h in r.hash_ids})
    prompts = _prompts(cell, load)
    concurrency = args.engines if cell.load == "closed" else 0
    replay = argparse.Namespace(time_scale=time_scale, max_output=args.max_output, concurrency=concurrency)
    runs = []
    for policy in cell_policies(cell, policies):
        shared_key = (policy, cell.client, cell.prompts)
        if policy in REPLICA_FREE and shared_key in engines.replica_free:
            runs.append({**engines.replica_free[shared_key], "replicas": int(cell.replicas)})
            continue
        print(f"  {cell.name}: {policy}", file=sys.stderr)
        stream = cell.client == "stream"
        replicas = int(cell.replicas)
        probe = bool(getattr(args, "probe", False))
        run, results = await replay_on_stack(
            engines.stack, policy, replicas, requests, prompts, replay, lru, load.after, stream, probe
        )
        runs.append(_run_figures(run, results, time_scale))
        if policy in REPLICA_FREE:
            engines.replica_free[shared_key] = runs[-1]
    relative_to_best(runs)
    return {
        "name": cell.name,
        "axes": cell.axes(),
        "metric": "ttft" if cell.client == "stream" else "latency",
        "requests": len(requests),
        "mean_prompt_tokens": round(load.mean_prompt_tokens, 1),
        "arrival_rate_per_s": round(load.rate, 4),
        "time_scale": round(time_scale, 4),
        "distinct_blocks": distinct,
        "cache_fraction": round(capacity / distinct, 4),
        "engine_kv_tokens": engines.engine_kv_tokens,
        "prompts_per_engine": round(engines.engine_kv_tokens / max(load.mean_prompt_tokens, 1), 2),
        "lru_reference_hit_rate": round(lru, 4),
        "infinite_cache_hit_rate": round(infinite, 4),
        "runs": runs,
    }


def cache_fraction(cache: str, load: Workload, engines: int) -> float:
    """The fleet's cache / the workload's distinct blocks: the cache axis's fraction, or for
    ``tiny`` what gives each engine room for :data:`TINY_PROMPTS` mean prompts."""
    if cache != "tiny":
        return CACHE[cache]
    distinct_tokens = len({h for r in load.requests for h in r.hash_ids}) * load.block_tokens
    return min(1.0, engines * TINY_PROMPTS * load.mean_prompt_tokens / max(distinct_tokens, 1))


@dataclass
class _Setting:
    """One engine setting's workload, engines and the arguments its cells run with."""

    load: Workload
    args: argparse.Namespace  # a fleet=pd setting's has --max-output raised to its replies
    engine: dict[str, Any]  # the Stack's engine keywords
    roles: list[str]
    capacity: int
    kv_tokens: int
    time_scale: float


def _setting(first: Cell, args: argparse.Namespace) -> _Setting:
    load = workload(
        first.tenants,
        first.load,
        args.requests_per_cell,
        args.seed,
        args.engines,
        args.prefill_ms_per_1k,
        args.block_size,
    )
    tiered = first.tiers in ("cpu", "disk")
    roles = pd_roles(args.engines) if first.fleet == "pd" else []
    if roles:  # replies long enough that decoding matters
        load = replace(load, requests=[replace(r, output_length=PD_OUTPUT_TOKENS) for r in load.requests])
        args = argparse.Namespace(**{**vars(args), "max_output": max(args.max_output, PD_OUTPUT_TOKENS)})
    fraction = TIERED_CACHE["gpu"] if tiered else cache_fraction(first.cache, load, args.engines)
    sizes = args.engines, args.block_size, args.max_output, load.block_tokens
    capacity, per_engine_blocks, max_model_len = fleet_capacity(load.requests, fraction, *sizes)
    engine: dict[str, Any] = {"num_blocks": per_engine_blocks, "block_size": args.block_size}
    engine["max_model_len"] = max_model_len
    if first.tiers == "cpu":
        engine["cpu_blocks"] = fleet_capacity(load.requests, TIERED_CACHE["cpu"], *sizes)[1]
        engine["cpu_load_ms_per_1k_tokens"] = CPU_LOAD_SHARE * args.prefill_ms_per_1k
    if first.tiers == "disk":
        engine["disk_blocks"] = fleet_capacity(load.requests, TIERED_CACHE["disk"], *sizes)[1]
        engine["disk_load_ms_per_1k_tokens"] = DISK_LOAD_SHARE * args.prefill_ms_per_1k
    kv_tokens = (per_engine_blocks - 1) * args.block_size  # block 0 is the null block
    return _Setting(load, args, engine, roles, capacity, kv_tokens, args.wall_rate / load.rate)


async def run_grid(cells: list[Cell], policies: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    with RedisServer() as server:
        for number, (_, group) in enumerate(itertools.groupby(cells, lambda c: c.engine_setting)):
            cells_here = list(group)
            first = cells_here[0]
            setting = _setting(first, args)
            redis = RedisSettings(url=server.url, prefix=f"regimes{number}")
            print(f"engines for {'/'.join(first.engine_setting)}: time scale {setting.time_scale:.2f}", file=sys.stderr)
            timing = _timing(setting.args, setting.time_scale, first)
            async with Stack(
                redis,
                engines=args.engines,
                timing=timing,
                engine_metrics=first.engine,
                roles=setting.roles,
                **setting.engine,
            ) as stack:
                shared = _Engines(stack, setting.load, setting.capacity, setting.kv_tokens, setting.time_scale, {})
                for cell in cells_here:
                    out.append(await _run_cell(shared, cell, policies, setting.args))
    return out


# --------------------------------------------------------------------------------- arguments


def check_args(args: argparse.Namespace) -> tuple[dict[str, tuple[str, ...]], list[Cell], list[str]]:
    """The grid, its cells and the policies; anything wrong is a :class:`StartupError` (one line, exit 2)."""
    try:
        axes, cells = grid(args.axis or [], args.full)
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    policies = policies_from(args.policies)
    if SGLANG in policies and not os.environ.get("KVROUTE_SGLANG_PYTHON"):
        if any(c.prompts == "text" for c in cells):
            print(
                "note: no sglang column: set KVROUTE_SGLANG_PYTHON to a Python with sglang-router installed",
                file=sys.stderr,
            )
        policies.remove(SGLANG)
    if not any(cell_policies(c, policies) for c in cells):
        raise StartupError("no policy to run: sglang runs on text cells only (--axis prompts=text)")
    return axes, cells, policies


def seeds_from(args: argparse.Namespace) -> list[int]:
    """``--seeds`` (comma-separated integers), else ``--seed``, else :data:`DEFAULT_SEEDS`."""
    if not getattr(args, "seeds", None):
        return [args.seed] if getattr(args, "seed", None) is not None else list(DEFAULT_SEEDS)
    try:
        seeds = list(dict.fromkeys(int(v) for v in args.seeds.split(",") if v.strip()))
    except ValueError:
        raise StartupError(f"--seeds takes comma-separated integers, got {args.seeds!r}") from None
    if not seeds:
        raise StartupError("--seeds names no seed")
    return seeds


async def run_seeds(cells: list[Cell], policies: list[str], args: argparse.Namespace, seeds: list[int]) -> list[dict]:
    out = []
    for seed in seeds:
        if len(seeds) > 1:
            print(f"seed {seed}", file=sys.stderr)
        for report in await run_grid(cells, policies, argparse.Namespace(**{**vars(args), "seed": seed})):
            out.append({**report, "seed": seed})
    return out


def run_from_args(args: argparse.Namespace) -> int:
    axes, cells, policies = check_args(args)
    seeds = seeds_from(args)
    print(f"{len(cells)} cells, policies {', '.join(policies)}, seeds {seeds}", file=sys.stderr)
    cell_reports = asyncio.run(run_seeds(cells, policies, args, seeds))
    judged = across_seeds(cell_reports) if len(seeds) > 1 else cell_reports
    report = {
        "grid": {name: list(values) for name, values in axes.items()},
        "settings": {
            "engines": args.engines,
            "prefill_ms_per_1k": args.prefill_ms_per_1k,
            "decode_ms_per_step": args.decode_ms_per_step,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_num_seqs": args.max_num_seqs,
            "block_size": args.block_size,
            "prefill_context_ns": getattr(args, "prefill_context_ns", 0.0),
            "parallel_chunk_tokens": PARALLEL_CHUNK_TOKENS,
            "max_output": args.max_output,
            "requests_per_cell": args.requests_per_cell,
            "wall_rate": args.wall_rate,
            "seed": seeds[0],
            "seeds": seeds,
        },
        "cells": cell_reports,
        "summary": summarize_policies(judged),
    }
    if len(seeds) > 1:
        report["across_seeds"] = judged
    print(render(report))
    if args.json:
        write_json(args.json, report, "results")
    if args.chart:
        from kvroute.bench.regimes_chart import chart

        print(charts.written(lambda: chart({**report, "cells": judged}, Path(args.chart)), Path(args.chart)))
    return 0
