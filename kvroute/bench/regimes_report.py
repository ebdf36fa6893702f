"""``kvroute bench regimes``: each run judged against the best of its cell, the seeds merged, and
the tables (pure: no processes). :mod:`kvroute.bench.regimes` runs the grid."""

from __future__ import annotations

import math
from typing import Any

from kvroute.bench.common import text_table
from kvroute.bench.lost_split import shares_text
from kvroute.bench.probe import split_text

WITHIN_MEAN, WITHIN_P90 = 1.10, 1.2
PROBE_COLUMN = "at send: best - choice - schedule"  # --probe (kvroute.bench.probe)


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
