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
import math
import os
import sys
from pathlib import Path
from typing import Any

from kvindex.settings import RedisSettings
from kvroute.bench.common import percentile, text_table, write_json
from kvroute.bench.regimes_workload import CACHE, Cell, Workload, grid, workload
from kvroute.bench.replay import fleet_capacity, prompts_for, replay_on_stack
from kvroute.bench.replay_workload import reference_hit_rates
from kvroute.devstack.embedded_redis import RedisServer
from kvroute.devstack.stack import Stack
from kvservice.lifecycle import StartupError
from router.accounting import shares_text
from router.scoring import Policy
from sim_engine.engine import TimingModel

SGLANG = "sglang"
DEFAULT_POLICIES = "kv,round_robin,least_loaded,prefix,sglang"
WITHIN_MEAN, WITHIN_P90 = 1.10, 1.2
HELD_S = 0.001  # a turn sent this much past its arrival time waited for the previous reply


def policies_from(flag: str) -> list[str]:
    known = [p.value for p in Policy] + [SGLANG]
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


# ------------------------------------------------------------------------------ relative figures


def _ratio(value: float, best: float) -> float:
    return value / best if best > 0 else 1.0


def relative_to_best(runs: list[dict[str, Any]]) -> None:
    """Set each run's ``ttft_vs_best``, ``p90_vs_best`` (its figure / the lowest of the cell) and
    ``hit_vs_best`` (its hit rate / the highest). Runs with failed requests are not candidates for
    best while a run without failures exists."""
    clean = [r for r in runs if not r["failed"]] or runs
    best_mean = min(r["ttft_mean_ms"] for r in clean)
    best_p90 = min(r["ttft_p90_ms"] for r in clean)
    best_hit = max(r["hit_rate"] for r in clean)
    for r in runs:
        r["ttft_vs_best"] = round(_ratio(r["ttft_mean_ms"], best_mean), 4)
        r["p90_vs_best"] = round(_ratio(r["ttft_p90_ms"], best_p90), 4)
        r["hit_vs_best"] = round(_ratio(r["hit_rate"], best_hit), 4)


def summarize_policies(cells: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per policy, over the cells it ran in: in how many its mean was within 1.10x of the best
    mean and its p90 within 1.2x of the best p90 (each, and both), and its worst ratios."""
    summary: dict[str, dict[str, Any]] = {}
    for cell in cells:
        for run in cell["runs"]:
            s = summary.setdefault(
                run["policy"],
                {
                    "cells": 0,
                    "within_mean": 0,
                    "within_p90": 0,
                    "within_both": 0,
                    "worst_mean_ratio": 0.0,
                    "worst_mean_cell": "",
                    "worst_p90_ratio": 0.0,
                    "worst_p90_cell": "",
                    "failed_requests": 0,
                },
            )
            mean_ok, p90_ok = run["ttft_vs_best"] <= WITHIN_MEAN, run["p90_vs_best"] <= WITHIN_P90
            s["cells"] += 1
            s["within_mean"] += mean_ok
            s["within_p90"] += p90_ok
            s["within_both"] += mean_ok and p90_ok
            s["failed_requests"] += run["failed"]
            if run["ttft_vs_best"] > s["worst_mean_ratio"]:
                s["worst_mean_ratio"], s["worst_mean_cell"] = run["ttft_vs_best"], cell["name"]
            if run["p90_vs_best"] > s["worst_p90_ratio"]:
                s["worst_p90_ratio"], s["worst_p90_cell"] = run["p90_vs_best"], cell["name"]
    return summary


def across_seeds(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One cell per name from its runs under several seeds: per policy the geometric mean of its
    ratios to the best (one noisy run decides nothing), the mean of its figures, the sum of its
    failures. The summary judges these."""
    by_name: dict[str, list[dict[str, Any]]] = {}
    for cell in cells:
        by_name.setdefault(cell["name"], []).append(cell)
    out = []
    for group in by_name.values():
        runs: dict[str, list[dict[str, Any]]] = {}
        for cell in group:
            for run in cell["runs"]:
                runs.setdefault(run["policy"], []).append(run)
        merged = [_merged_run(policy, seed_runs) for policy, seed_runs in runs.items()]
        shared = {k: v for k, v in group[0].items() if k not in ("runs", "seed")}
        out.append({**shared, "runs": merged, "seeds": [cell.get("seed") for cell in group]})
    return out


def _merged_run(policy: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    def geomean(key: str) -> float:
        return round(math.exp(sum(math.log(max(r[key], 1e-9)) for r in runs) / len(runs)), 4)

    def mean(key: str) -> float:
        return round(sum(r[key] for r in runs) / len(runs), 4)

    ratios = {key: geomean(key) for key in ("ttft_vs_best", "p90_vs_best", "hit_vs_best")}
    figures = {key: mean(key) for key in ("ttft_mean_ms", "ttft_p90_ms", "hit_rate", "of_lru")}
    return {"policy": policy, **figures, **ratios, "failed": sum(r["failed"] for r in runs), "runs": len(runs)}


# ------------------------------------------------------------------------------------- running


def _timing(args: argparse.Namespace, speedup: float) -> TimingModel:
    limits: dict[str, int] = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens}
    if "max_num_batched_tokens" not in inspect.signature(TimingModel).parameters:
        limits = {"max_running": args.max_num_seqs}  # a simulated engine from before the token budget
    return TimingModel(
        prefill_ms_per_1k_tokens=args.prefill_ms_per_1k,
        decode_ms_per_step=args.decode_ms_per_step,
        step_overhead_ms=1.0,
        speedup=speedup,
        **limits,  # type: ignore[arg-type]
    )


def _run_figures(run: Any, results: list[dict[str, Any]], time_scale: float) -> dict[str, Any]:
    """A run's row: times in the engines' clock (wall x time scale)."""
    return {
        "policy": run.router,
        "replicas": run.replicas,
        "ttft_mean_ms": round(run.ttft_mean_ms * time_scale, 2),
        "ttft_p90_ms": round(percentile(run.ttft_ms, 0.9) * time_scale, 2),
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
    }


async def _run_cell(
    stack: Stack,
    cell: Cell,
    load: Workload,
    capacity: int,
    engine_kv_tokens: int,
    time_scale: float,
    policies: list[str],
    args: Any,
) -> dict[str, Any]:
    requests = load.requests
    lru, infinite = reference_hit_rates(requests, capacity)
    distinct = len({h for r in requests for h in r.hash_ids})
    prompts = prompts_for(requests, cell.prompts == "text")
    replay = argparse.Namespace(time_scale=time_scale, max_output=args.max_output, concurrency=0)
    runs = []
    for policy in cell_policies(cell, policies):
        print(f"  {cell.name}: {policy}", file=sys.stderr)
        run, results = await replay_on_stack(
            stack, policy, int(cell.replicas), requests, prompts, replay, lru, load.after, cell.client == "stream"
        )
        runs.append(_run_figures(run, results, time_scale))
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
        "engine_kv_tokens": engine_kv_tokens,
        "lru_reference_hit_rate": round(lru, 4),
        "infinite_cache_hit_rate": round(infinite, 4),
        "runs": runs,
    }


async def run_grid(cells: list[Cell], policies: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    with RedisServer() as server:

        def engine_setting(cell: Cell) -> tuple[str, str, str]:
            return cell.tenants, cell.load, cell.cache

        for number, (setting, group) in enumerate(itertools.groupby(cells, engine_setting)):
            tenants, load_name, cache = setting
            load = workload(tenants, load_name, args.requests_per_cell, args.seed, args.engines, args.prefill_ms_per_1k)
            sizes = CACHE[cache], args.engines, args.block_size, args.max_output
            capacity, per_engine_blocks, max_model_len = fleet_capacity(load.requests, *sizes)
            time_scale = args.wall_rate / load.rate
            redis = RedisSettings(url=server.url, prefix=f"regimes{number}")
            engine = {"num_blocks": per_engine_blocks, "block_size": args.block_size, "max_model_len": max_model_len}
            print(f"engines for {tenants}/{load_name}/{cache}: time scale {time_scale:.2f}", file=sys.stderr)
            async with Stack(redis, engines=args.engines, timing=_timing(args, time_scale), **engine) as stack:
                for cell in group:
                    kv_tokens = (per_engine_blocks - 1) * args.block_size  # block 0 is the null block
                    out.append(await _run_cell(stack, cell, load, capacity, kv_tokens, time_scale, policies, args))
    return out


# -------------------------------------------------------------------------------------- output


def render(report: dict[str, Any]) -> str:
    blocks = []
    several = "across_seeds" in report
    for cell in report["cells"]:
        what = "TTFT" if cell["metric"] == "ttft" else "latency (not streamed: time to the whole reply)"
        seed = f" (seed {cell.get('seed')})" if several else ""
        blocks.append(
            f"{cell['name']}{seed}: {cell['requests']} requests at {cell['arrival_rate_per_s']:.2f}/s "
            f"(mean prompt {cell['mean_prompt_tokens']:.0f} tokens), caches {cell['cache_fraction']:.0%} of "
            f"{cell['distinct_blocks']} distinct blocks ({cell['engine_kv_tokens']} tokens per engine), "
            f"shared-LRU reference {cell['lru_reference_hit_rate']:.1%}; {what} in engine ms"
        )
        rows = [
            [
                r["policy"],
                f"{r['ttft_mean_ms']:.1f}",
                f"{r['ttft_p90_ms']:.1f}",
                f"{r['hit_rate']:.1%}",
                f"{r['of_lru']:.1%}",
                f"{r['ttft_vs_best']:.2f}",
                f"{r['p90_vs_best']:.2f}",
                f"{r['hit_vs_best']:.2f}",
                r["failed"],
                shares_text(r.get("lost_share"), r.get("degraded_share")),
            ]
            for r in cell["runs"]
        ]
        # the new column last: the columns that were there keep their places
        headers = [
            *("policy", "mean ms", "p90 ms", "hit rate", "of LRU", "ttft/best", "p90/best", "hit/best"),
            *("failed", "lost load/stale/cold"),
        ]
        blocks.append(text_table(headers, rows) + "\n")
    if several:
        blocks.append(render_across(report["across_seeds"]))
    judged = "each cell's geometric mean over the seeds, " if several else ""
    blocks.append(f"summary ({judged}within {WITHIN_MEAN:.2f}x of the best mean, {WITHIN_P90:.1f}x of the best p90):")
    for policy, s in report["summary"].items():
        blocks.append(summary_line(policy, s))
    return "\n".join(blocks)


def render_across(cells: list[dict[str, Any]]) -> str:
    """Per cell and policy, the geometric means of the ratios over the seeds and the mean figures."""
    rows = [
        [
            cell["name"],
            r["policy"],
            f"{r['ttft_vs_best']:.2f}",
            f"{r['p90_vs_best']:.2f}",
            f"{r['ttft_mean_ms']:.1f}",
            f"{r['of_lru']:.1%}",
            r["failed"],
        ]
        for cell in cells
        for r in cell["runs"]
    ]
    headers = ["cell", "policy", "ttft/best", "p90/best", "mean ms", "of LRU", "failed"]
    return "across seeds (geometric means of the ratios, mean figures):\n" + text_table(headers, rows) + "\n"


def summary_line(policy: str, s: dict[str, Any]) -> str:
    n = s["cells"]
    line = (
        f"{policy}: mean within {WITHIN_MEAN:.2f}x in {s['within_mean']}/{n} cells, p90 within {WITHIN_P90:.1f}x "
        f"in {s['within_p90']}/{n}, both in {s['within_both']}/{n}; worst mean {s['worst_mean_ratio']:.2f}x "
        f"({s['worst_mean_cell']}), worst p90 {s['worst_p90_ratio']:.2f}x ({s['worst_p90_cell']})"
    )
    return line + (f"; {s['failed_requests']} failed requests" if s["failed_requests"] else "")


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
    """``--seeds`` (comma-separated integers) or else ``--seed``."""
    if not getattr(args, "seeds", None):
        return [args.seed]
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

        chart({**report, "cells": judged}, Path(args.chart))
        print(f"chart written to {Path(args.chart).resolve()}")
    return 0
