"""The text of ``kvroute bench replay``'s results: each run, and with ``--repeats`` each router's
mean and range over its runs."""

from __future__ import annotations

import statistics
from typing import Any

from kvroute.bench.lost_split import shares_text
from kvroute.bench.probe import split_text
from router.routing.accounting import REASONS


def render(results: dict[str, Any]) -> str:
    lines = [
        f"{results['requests']} requests ({results['prompts']}), {results['engines']} engines, caches = "
        f"{results['cache_fraction']:.0%} of {results['distinct_trace_blocks']} distinct blocks; references: "
        f"shared LRU {results['lru_reference_hit_rate']:.1%}, infinite {results['infinite_cache_hit_rate']:.1%}",
        "router        replicas  hit rate  of LRU   TTFT mean ms  TTFT p99 ms  busiest/mean  failed  "
        "lost load/stale/cold",
    ]
    probed = any(r.get("probe_split") for r in results["runs"])
    if probed:  # new columns last: the columns that were there keep their places
        lines[-1] = f"{lines[-1]:<120} at send: best - choice - schedule"
    for r in results["runs"]:
        line = (
            f"{r['router']:<13} {r['replicas']:<9} {r['hit_rate']:<9.1%} {r['of_lru_reference']:<8.1%} "
            f"{r['ttft_mean_ms']:<13.1f} {r['ttft_p99_ms']:<12.1f} {r['busiest_worker_vs_mean']:<13.2f} "
            f"{r['failed']:<7} {shares_text(r.get('lost_share'), r.get('degraded_share'))}"
        )
        lines.append(f"{line:<120} {split_text(r.get('probe_split'))}" if probed else line)
    lines.append(f"lost: shares of the cacheable prompt tokens lost to {', '.join(REASONS)} (docs/dashboard.md)")
    if probed:
        lines.append("at send: the best any engine held, what the choice gave up, what was evicted before scheduling")
    if results.get("averages"):
        lines += [
            "",
            "over the repeats: mean (min-max)",
            "router        replicas  runs  of LRU                  TTFT mean ms",
        ]
        for row in results["averages"]:
            share, ttft = row["of_lru_reference"], row["ttft_mean_ms"]
            share_text = f"{share['mean']:.1%} ({share['min']:.1%}-{share['max']:.1%})"
            ttft_text = f"{ttft['mean']:.1f} ({ttft['min']:.1f}-{ttft['max']:.1f})"
            lines.append(f"{row['router']:<13} {row['replicas']:<9} {row['runs']:<5} {share_text:<23} {ttft_text}")
    return "\n".join(lines)


def averages(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (router, replicas), in the order first run: the mean and range over its repeats of the
    figures a target is judged on (one run of a trace can be off by many points)."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault((run["router"], run["replicas"]), []).append(run)
    rows = []
    for (router, replicas), group in groups.items():
        row: dict[str, Any] = {"router": router, "replicas": replicas, "runs": len(group)}
        for name in ("hit_rate", "of_lru_reference", "ttft_mean_ms", "ttft_p99_ms", "busiest_worker_vs_mean"):
            values = [r[name] for r in group]
            row[name] = {"mean": statistics.mean(values), "min": min(values), "max": max(values)}
        rows.append(row)
    return rows
