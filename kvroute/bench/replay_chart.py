"""The PNG of ``kvroute bench replay``: hit rate per run against the references, hit rate over
time, and each run's time-to-first-token distribution."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def chart(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    fig, (bars, over_time, cdf) = plt.subplots(1, 3, figsize=(16, 4.2))
    labels = [f"{r['router']}\n{r['replicas']} replica(s)" for r in runs]
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
    fig.suptitle(f"kvroute bench replay: {results['requests']} requests, {results['engines']} engines")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
