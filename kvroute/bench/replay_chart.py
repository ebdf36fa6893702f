"""The PNG of ``kvroute bench replay``: hit rate per run against the references, hit rate over
time, each run's time-to-first-token distribution, and where each run lost cacheable prefix
tokens (load trade-off, stale index, cold: docs/dashboard.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvroute import charts


def chart(results: dict[str, Any], path: Path) -> None:
    plt = charts.pyplot()
    runs = results["runs"]
    fig, (bars, over_time, cdf, lost) = plt.subplots(1, 4, figsize=(21, 4.2))
    repeated = bool(results.get("averages"))  # --repeats: several runs of each router
    labels = [f"{r['router']}\n{r['replicas']} replica(s)" + (f" #{r['repeat'] + 1}" if repeated else "") for r in runs]
    bars.bar(labels, [100 * r["hit_rate"] for r in runs], color="#2a7")
    bars.axhline(100 * results["lru_reference_hit_rate"], color="#555", linestyle="--", label="one shared LRU cache")
    bars.axhline(100 * results["infinite_cache_hit_rate"], color="#c55", linestyle=":", label="infinite cache")
    bars.set_title("cache hit rate (%)", fontsize=10)
    bars.tick_params(axis="x", labelsize=7)
    bars.legend(fontsize=8)
    for r, label in zip(runs, labels, strict=True):
        name = label.replace("\n", ", ")
        points = r["hit_rate_over_time"]
        over_time.plot([(i + 1) / len(points) for i in range(len(points))], [100 * h for h in points], label=name)
        ttfts = sorted(r["ttft_ms"])
        cdf.plot(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], label=name)
    over_time.set_title("hit rate (%) over the replay (fraction of requests done)", fontsize=10)
    over_time.legend(fontsize=7)
    cdf.set_xscale("log")
    cdf.set_title("time to first token (ms), CDF", fontsize=10)
    cdf.legend(fontsize=7)
    _lost(lost, runs, labels)
    fig.suptitle(f"kvroute bench replay: {results['requests']} requests, {results['engines']} engines")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _lost(axis: Any, runs: list[dict[str, Any]], labels: list[str]) -> None:
    """Stacked bars: each run's lost shares of its cacheable tokens (a peer's are unknown: none)."""
    bottom = [0.0] * len(runs)
    for reason, color in (("load_tradeoff", "#e0a030"), ("stale_index", "#c55"), ("cold", "#8a8fa0")):
        shares = [100 * ((r.get("lost_share") or {}).get(reason) or 0.0) for r in runs]
        axis.bar(labels, shares, bottom=bottom, color=color, label=reason.replace("_", " "))
        bottom = [b + s for b, s in zip(bottom, shares, strict=True)]
    axis.set_title("cacheable prompt tokens lost (%), by reason", fontsize=10)
    axis.tick_params(axis="x", labelsize=7)
    axis.legend(fontsize=8)
