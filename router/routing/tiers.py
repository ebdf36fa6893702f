"""What a prefix found in a worker's lower cache tier (CPU, disk, remote: kvindex/tiers.py) is
worth to the cost: pure functions, no I/O (docs/router.md, "Cache tiers").

An engine serves a prompt's prefix from its GPU cache first; past that, the blocks a lower tier
holds are loaded (vLLM's KV connectors: its CPU offloading, LMCache), each from the fastest tier
that holds it, and only the rest is computed. A tier's worth is time: loading a block costs its
bytes over the tier's bandwidth, against computing it again. The router takes each tier's load
time per 1k tokens from ``--tier-load-ms`` (defaults from an H200 with an 8B model, bf16: 128 KiB
of KV per token, host memory over PCIe Gen5 ~50 GB/s: ~2.5-5 ms per 1k tokens; a local NVMe drive
~7 GB/s: ~18-37 ms; a remote store slower still), and compares it with the compute time it
learned. Two other modes stand beside it for comparison: fixed weights per tier (Dynamo's 1.0 /
0.75 / 0.25 for GPU / host / disk) and tiers ignored (only the GPU counts).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Final

from kvindex.tiers import LOWER_TIERS, parse_tiers
from kvservice.declared import one_of, setting

DEFAULT_LOAD_MS_PER_1K: Final = MappingProxyType({"CPU": 4.0, "DISK": 30.0, "REMOTE": 60.0})
DYNAMO_WEIGHTS: Final = MappingProxyType({"CPU": 0.75, "DISK": 0.25, "REMOTE": 0.25})
TIERS_GROUP = "cache tiers"  # the --help section of the tier settings


class TierMode(StrEnum):
    TIME = "time"  # a loaded block costs its load time (--tier-load-ms)
    LEARNED = "learned"  # a load costs what TTFTs taught: a wait per load and a time per token
    WEIGHTS = "weights"  # a loaded block counts as cached by its tier's weight, at no time
    IGNORE = "ignore"  # only the GPU's blocks count: the router as it was before tiers


@dataclass(frozen=True)
class TierCosts:
    mode: TierMode = setting(
        TierMode.TIME,
        flag="--tier-cost",
        parse=one_of(TierMode),
        choices=tuple(TierMode),
        group=TIERS_GROUP,
        help="what a block in a worker's lower cache tier is worth: time (its load time, --tier-load-ms), "
        "learned (a wait per load and a time per token learned from TTFTs, starting there), weights (a GPU hit "
        "times its tier's weight, Dynamo's), ignore (only GPU blocks count)",
    )
    load_ms_per_1k: Mapping[str, float] = setting(
        default_factory=lambda: DEFAULT_LOAD_MS_PER_1K,
        flag="--tier-load-ms",
        metavar="TIER=MS,...",
        parse=lambda where, text: parse_tier_values(text, where),
        group=TIERS_GROUP,
        help="load time per 1k tokens of each lower tier (the defaults: an 8B model's KV over PCIe Gen5, a local "
        "NVMe, a remote store)",
    )
    weights: Mapping[str, float] = setting(
        default_factory=lambda: DYNAMO_WEIGHTS,
        flag="--tier-weights",
        metavar="TIER=W,...",
        parse=lambda where, text: parse_tier_values(text, where),
        group=TIERS_GROUP,
        help="with --tier-cost weights: each lower tier's weight of a GPU hit (the defaults are Dynamo's)",
    )

    def __post_init__(self) -> None:
        for name, values in (("--tier-load-ms", self.load_ms_per_1k), ("--tier-weights", self.weights)):
            for tier, value in values.items():
                if tier not in LOWER_TIERS or not value >= 0:
                    raise ValueError(f"{name}: {tier}={value} is not a lower tier with a value >= 0")
        if any(w > 1 for w in self.weights.values()):
            raise ValueError("--tier-weights: a tier's weight is at most 1 (a GPU hit)")

    def load_s_per_token(self, tier: str) -> float:
        return self.load_ms_per_1k.get(tier, DEFAULT_LOAD_MS_PER_1K[tier]) / 1e6

    def weight(self, tier: str) -> float:
        return self.weights.get(tier, 0.0)


def loadable(tier_depths: Sequence[int], hit_blocks: int, prompt_blocks: int) -> tuple[int, ...]:
    """The prompt's blocks past ``hit_blocks`` (the GPU's) that each lower tier would load, the
    engine taking each block from the fastest tier that holds it; ``tier_depths`` is each lower
    tier's prefix depth (kvindex.tiers.LOWER_TIERS order), counted from the prompt's first block."""
    loaded = []
    covered = hit_blocks
    for depth in tier_depths:
        reach = min(depth, prompt_blocks)
        loaded.append(max(reach - covered, 0))
        covered = max(covered, reach)
    return tuple(loaded)


def parse_tier_values(text: str, flag: str) -> dict[str, float]:
    """``CPU=4,DISK=30`` -> {"CPU": 4.0, "DISK": 30.0}; a ValueError naming ``flag`` for anything else."""
    values: dict[str, float] = {}
    for item in (part.strip() for part in text.split(",") if part.strip()):
        name, sep, number = item.partition("=")
        try:
            (tier,) = parse_tiers(name) - {"GPU"}
            values[tier] = float(number)
        except ValueError:
            raise ValueError(
                f"{flag} takes TIER=NUMBER,... with tiers {', '.join(LOWER_TIERS)}, got {item!r}"
            ) from None
        if not sep or not values[tier] >= 0:
            raise ValueError(f"{flag} takes TIER=NUMBER,... with numbers >= 0, got {item!r}")
    return values
