"""The PNG of ``kvroute bench regimes``: cells x policies heat maps. Left: mean TTFT (latency in
non-streamed cells) / the best mean in the cell, annotated with the ratio and the mean; right: hit
rate as a fraction of the shared-LRU reference of the cell's capacity. Judged over several seeds,
each square also gives the range of its figure over the seeds. A policy that did not run in a
cell (sglang outside text cells) is a grey square."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from kvroute import charts

WORST_SHOWN = 2.0  # ratios at or above this get the darkest colour


def _grid(report: dict[str, Any], key: str) -> tuple[list[str], list[str], list[list[float]], list[list[str]]]:
    policies = list(dict.fromkeys(r["policy"] for c in report["cells"] for r in c["runs"]))
    rows, values, notes = [], [], []
    for cell in report["cells"]:
        rows.append(cell["name"] + (" (latency)" if cell["metric"] == "latency" else ""))
        by_policy = {r["policy"]: r for r in cell["runs"]}
        values.append([by_policy[p][key] if p in by_policy else math.nan for p in policies])
        notes.append([_note(by_policy.get(p), key) for p in policies])
    return rows, policies, values, notes


def _note(run: dict[str, Any] | None, key: str) -> str:
    if run is None:
        return ""
    failed = f"\n{run['failed']} failed" if run["failed"] else ""
    low, high = run.get("spread", {}).get(key, (None, None))
    if key == "ttft_vs_best":
        spread = f"\n{low:.2f}-{high:.2f}" if low is not None else ""
        return f"{run[key]:.2f}x{spread}\n{run['ttft_mean_ms']:.0f} ms{failed}"
    spread = f"\n{low:.0%}-{high:.0%}" if low is not None else ""
    return f"{run[key]:.0%}{spread}{failed}"


def chart(report: dict[str, Any], path: Path) -> None:
    plt = charts.pyplot()
    rows, policies, ratios, ratio_notes = _grid(report, "ttft_vs_best")
    _, _, of_lru, lru_notes = _grid(report, "of_lru")
    height = 1.6 + 0.55 * len(rows)
    fig, (left, right) = plt.subplots(1, 2, figsize=(6 + 2.4 * len(policies), height), sharey=True)
    panels = (
        (left, ratios, ratio_notes, "RdYlGn_r", (1.0, WORST_SHOWN), "mean TTFT / best mean in the cell"),
        (right, of_lru, lru_notes, "RdYlGn", (0.0, 1.2), "hit rate / shared-LRU reference"),
    )
    for axes, values, notes, colours, (low, high), title in panels:
        cmap = plt.colormaps[colours].copy()
        cmap.set_bad("#ddd")
        image = axes.imshow(values, cmap=cmap, vmin=low, vmax=high, aspect="auto")
        axes.set_xticks(range(len(policies)), policies, fontsize=9)
        axes.set_yticks(range(len(rows)), rows, fontsize=8)
        axes.xaxis.tick_top()
        axes.set_title(title, fontsize=10, pad=22)
        for y, row in enumerate(notes):
            for x, text in enumerate(row):
                shade = (values[y][x] - low) / (high - low)
                dark = not math.isnan(shade) and not 0.12 < shade < 0.85  # both ends of the map are dark
                axes.text(x, y, text, ha="center", va="center", fontsize=7.5, color="white" if dark else "black")
        fig.colorbar(image, ax=axes, fraction=0.04, pad=0.02)
    settings = report.get("settings", {})
    fig.suptitle(
        f"kvroute bench regimes: {len(rows)} cells, {settings.get('requests_per_cell', '?')} requests per run, "
        f"{settings.get('engines', '?')} engines (times in the engines' clock)",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
