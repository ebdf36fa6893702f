"""The tables of ``kvroute bench real``: each cell's policies over seeds, the targets, and the
simulator against real vLLM cell by cell (``--compare``). Pure but for reading the JSON files."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from kvroute.bench.common import text_table
from kvroute.bench.lost_split import shares_text

CALIBRATED_WITHIN = 0.03  # the simulator's hit rate within 3 points of real vLLM's, per cell and policy
LOAD_FREE_RATIO = 0.97  # kv's hit rate >= this x prefix's where load does not bind (closed loop)
BALANCED = 1.25  # kv's busiest engine <= this x the mean, where prefix's is
REPLICAS_WITHIN = 0.02


def _mean(values: list[float]) -> float:
    return statistics.mean(values) if values else 0.0


def summarize(cells: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per cell, per policy: the mean over seeds of the hit rate (with its range), of the shared-LRU
    reference's, the busiest engine over the mean, the lost split and the latency."""
    runs: dict[str, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for cell in cells:
        for run in cell["runs"]:
            runs[cell["cell"]][run["policy"]].append(run)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for name, policies in runs.items():
        out[name] = {}
        for policy, seeds in policies.items():
            hits = [r["hit_rate"] for r in seeds]
            lost = [r["lost_share"] for r in seeds if r.get("lost_share")]
            out[name][policy] = {
                "seeds": len(seeds),
                "hit_rate": round(_mean(hits), 4),
                "hit_rate_min": min(hits),
                "hit_rate_max": max(hits),
                "of_lru": round(_mean([r["of_lru"] for r in seeds]), 4),
                "busiest_vs_mean": round(_mean([r["busiest_vs_mean"] for r in seeds]), 3),
                "busiest_vs_mean_max": max(r["busiest_vs_mean"] for r in seeds),
                "latency_mean_ms": round(_mean([r["latency_mean_ms"] for r in seeds]), 1),
                "failed": sum(r["failed"] for r in seeds),
                "lost_share": {k: round(_mean([x[k] for x in lost]), 4) for k in lost[0]} if lost else None,
            }
    return out


def targets(summary: dict[str, dict[str, dict[str, Any]]]) -> list[tuple[str, str, str]]:
    """(cell, target, "met"/"MISSED" with the figures) for issue 55's targets on real vLLM."""
    out = []
    for name, policies in summary.items():
        kv = policies.get("kv")
        if kv is None:
            continue
        prefix = policies.get("prefix")
        if prefix and "/closed/" in name:
            ratio = kv["hit_rate"] / max(prefix["hit_rate"], 1e-9)
            out.append((name, "kv >= 0.97x prefix", _verdict(ratio >= LOAD_FREE_RATIO, f"{ratio:.3f}x")))
        for other in ("least_loaded", "round_robin"):
            if other in policies:
                gap = kv["hit_rate"] - policies[other]["hit_rate"]
                out.append((name, f"kv >= {other}", _verdict(gap >= 0, f"{100 * gap:+.1f} points")))
        if prefix and prefix["busiest_vs_mean"] <= BALANCED:
            busiest = kv["busiest_vs_mean"]
            out.append((name, "kv busiest <= 1.25x mean", _verdict(busiest <= BALANCED, f"{busiest:.2f}x")))
        one = summary.get(name.replace("/r2", "/r1"), {}).get("kv") if name.endswith("/r2") else None
        if one is not None:
            gap = kv["hit_rate"] - one["hit_rate"]
            verdict = _verdict(abs(gap) <= REPLICAS_WITHIN, f"{100 * gap:+.1f}")
            out.append((name, "2 replicas within 2 points of 1", verdict))
    return out


def _verdict(met: bool, figure: str) -> str:
    return f"{'met' if met else 'MISSED'} ({figure})"


def render(report: dict[str, Any]) -> str:
    settings = report["settings"]
    lines = [
        f"{settings['engines']} {settings['engine']} engines, block size {settings['block_size']}, "
        f"caches {settings['cache_blocks']} blocks, max-num-seqs {settings['max_num_seqs']}, seeds {settings['seeds']}"
    ]
    headers = ["policy", "hit rate", "(range)", "of LRU", "busiest/mean", "lost load/stale/cold", "latency ms"]
    headers.append("failed")
    for name, policies in report["summary"].items():
        rows = []
        for policy, s in policies.items():
            lost = s["lost_share"]
            split = shares_text(lost)
            rows.append(
                [
                    policy,
                    f"{100 * s['hit_rate']:.1f}%",
                    f"{100 * s['hit_rate_min']:.1f}-{100 * s['hit_rate_max']:.1f}",
                    f"{100 * s['of_lru']:.1f}%",
                    f"{s['busiest_vs_mean']:.2f} (max {s['busiest_vs_mean_max']:.2f})",
                    split,
                    f"{s['latency_mean_ms']:.1f}",
                    s["failed"],
                ]
            )
        lines += ["", name, text_table(headers, rows)]
    checked = targets(report["summary"])
    if checked:
        lines += ["", "targets", text_table(["cell", "target", "verdict"], checked)]
    return "\n".join(lines)


def compare_files(first: str, second: str) -> str:
    """Each (cell, policy) both files ran: the mean hit rates and their difference in points,
    marked where more than 3 points apart (the simulator models vLLM wrongly there)."""
    a, b = (json.loads(Path(p).read_text())["summary"] for p in (first, second))
    rows, off = [], 0
    for name in a:
        for policy in a[name]:
            if policy not in b.get(name, {}):
                continue
            x, y = a[name][policy]["hit_rate"], b[name][policy]["hit_rate"]
            apart = abs(x - y) > CALIBRATED_WITHIN
            off += apart
            figures = [f"{100 * x:.1f}%", f"{100 * y:.1f}%", f"{100 * (y - x):+.1f}"]
            rows.append([name, policy, *figures, "OFF" if apart else ""])
    table = text_table(["cell", "policy", Path(first).name, Path(second).name, "points", ""], rows)
    return f"{table}\n{off} of {len(rows)} (cell, policy) pairs more than {100 * CALIBRATED_WITHIN:.0f} points apart"
