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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvindex.settings import RedisSettings
from kvroute.bench.common import percentile, text_table, write_json
from kvroute.bench.probe import split_text
from kvroute.bench.regimes_workload import CACHE, TINY_PROMPTS, Cell, Workload, grid, workload
from kvroute.bench.replay import GREEDY_ORACLE, fleet_capacity, prompts_for, replay_on_stack
from kvroute.bench.replay_workload import reference_hit_rates
from kvroute.devstack.embedded_redis import RedisServer
from kvroute.devstack.stack import Stack
from kvservice.lifecycle import StartupError
from router.accounting import shares_text
from router.scoring import Policy
from router.tokenizer import ModelPrompts
from sim_engine.engine import TimingModel
from sim_engine.settings import TINY_MODEL_DIR

SGLANG = "sglang"
DEFAULT_POLICIES = "kv,round_robin,least_loaded,prefix,greedy_oracle,sglang"
WITHIN_MEAN, WITHIN_P90 = 1.10, 1.2
PROBE_COLUMN = "at send: best - choice - schedule"  # --probe (kvroute.bench.probe)
DEFAULT_SEEDS = (1, 2, 3, 4)  # one run of a tight cell can be off by 2x: a cell is judged over seeds
HELD_S = 0.001  # a turn sent this much past its arrival time waited for the previous reply
# prefill=parallel: each request's chunk per step (its own lane), so that a request that arrives
# while another's long prefill runs waits at most one short step, not the whole prefill
PARALLEL_CHUNK_TOKENS = 256
# Routers whose run does not depend on the replica count: run once per cell and seed, shared by
# the cells that differ only in replicas (the oracle is one process that knows everything).
REPLICA_FREE = (GREEDY_ORACLE,)


def policies_from(flag: str) -> list[str]:
    known = [p.value for p in Policy] + [GREEDY_ORACLE, SGLANG]
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
    exact = [r["prediction_exact"] for r in runs if r.get("prediction_exact") is not None]
    # the range over the seeds of each figure and ratio: how far one seed can be from the mean
    spread = {key: [min(r[key] for r in runs), max(r[key] for r in runs)] for key in (*ratios, *figures)}
    failed = sum(r["failed"] for r in runs)
    merged = {"policy": policy, **figures, **ratios, "failed": failed, "runs": len(runs), "spread": spread}
    exact_mean = round(sum(exact) / len(exact), 4) if exact else None
    return {**merged, "prediction_exact": exact_mean, "probe": _mean_split(runs)}


def _mean_split(runs: list[dict[str, Any]]) -> dict[str, float] | None:
    """The probes' split averaged over the seeds (None where a run was not probed)."""
    splits: list[dict[str, float]] = [r["probe"] for r in runs if r.get("probe")]
    if not splits or len(splits) < len(runs):
        return None
    return {key: round(sum(s[key] for s in splits) / len(splits), 4) for key in splits[0]}


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


async def run_grid(cells: list[Cell], policies: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    with RedisServer() as server:
        for number, (_, group) in enumerate(itertools.groupby(cells, lambda c: c.engine_setting)):
            cells_here = list(group)
            first = cells_here[0]
            tenants, load_name, cache = first.tenants, first.load, first.cache
            load = workload(
                tenants,
                load_name,
                args.requests_per_cell,
                args.seed,
                args.engines,
                args.prefill_ms_per_1k,
                args.block_size,
            )
            fraction = cache_fraction(cache, load, args.engines)
            sizes = fraction, args.engines, args.block_size, args.max_output, load.block_tokens
            capacity, per_engine_blocks, max_model_len = fleet_capacity(load.requests, *sizes)
            time_scale = args.wall_rate / load.rate
            redis = RedisSettings(url=server.url, prefix=f"regimes{number}")
            engine = {"num_blocks": per_engine_blocks, "block_size": args.block_size, "max_model_len": max_model_len}
            setting = "/".join(first.engine_setting)
            print(f"engines for {setting}: time scale {time_scale:.2f}", file=sys.stderr)
            timing = _timing(args, time_scale, first)
            async with Stack(
                redis, engines=args.engines, timing=timing, engine_metrics=first.engine, **engine
            ) as stack:
                kv_tokens = (per_engine_blocks - 1) * args.block_size  # block 0 is the null block
                shared = _Engines(stack, load, capacity, kv_tokens, time_scale, {})
                for cell in cells_here:
                    out.append(await _run_cell(shared, cell, policies, args))
    return out


# -------------------------------------------------------------------------------------- output


def render(report: dict[str, Any]) -> str:
    blocks = []
    several = "across_seeds" in report
    probed = any(r.get("probe") for cell in report["cells"] for r in cell["runs"])
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
                "n/a" if r.get("prediction_exact") is None else f"{r['prediction_exact']:.1%}",
                *([split_text(r.get("probe"))] if probed else []),
            ]
            for r in cell["runs"]
        ]
        # new columns last: the columns that were there keep their places
        headers = [
            *("policy", "mean ms", "p90 ms", "hit rate", "of LRU", "ttft/best", "p90/best", "hit/best"),
            *("failed", "lost load/stale/cold", "predicted exact", *([PROBE_COLUMN] if probed else [])),
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
    probed = any(r.get("probe") for cell in cells for r in cell["runs"])

    def span(r: dict[str, Any], key: str, form: str) -> str:
        low, high = r.get("spread", {}).get(key, (r[key], r[key]))
        return f"{format(low, form)}-{format(high, form)}"

    rows = [
        [
            cell["name"],
            r["policy"],
            f"{r['ttft_vs_best']:.2f}",
            span(r, "ttft_vs_best", ".2f"),
            f"{r['p90_vs_best']:.2f}",
            f"{r['ttft_mean_ms']:.1f}",
            f"{r['of_lru']:.1%}",
            span(r, "of_lru", ".0%"),
            r["failed"],
            "n/a" if r.get("prediction_exact") is None else f"{r['prediction_exact']:.1%}",
            *([split_text(r.get("probe"))] if probed else []),
        ]
        for cell in cells
        for r in cell["runs"]
    ]
    headers = ["cell", "policy", "ttft/best", "seeds' range", "p90/best", "mean ms", "of LRU", "seeds' range"]
    headers += ["failed", "predicted exact", *([PROBE_COLUMN] if probed else [])]
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

        chart({**report, "cells": judged}, Path(args.chart))
        print(f"chart written to {Path(args.chart).resolve()}")
    return 0
