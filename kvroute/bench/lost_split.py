"""The routers' lost-token split read from outside: what a benchmark or the demo reads from the
routers' /metrics pages before and after a run, and how the tables print it. (The split itself is
counted by the routers: router/routing/accounting.py.)"""

from __future__ import annotations

from kvservice.metrics_page import MetricsPage
from router.routing.accounting import DEGRADED, REASONS


def lost_from_exposition(text: str) -> dict[str, float] | None:
    """From a router's /metrics page: its lost prefix tokens by reason and its cacheable tokens
    (``{reason: tokens, "cacheable": tokens}``), with its decisions and how many of them were
    degraded (made without Redis: their tokens are in no reason); None when it exports no
    accounting (a peer, or a kvroute router from before it). Benchmarks read it before and after a run."""
    page = MetricsPage.parse(text)
    found = page.by_label("kvroute_router_lost_prefix_tokens_total", "reason")
    cacheable = list(page.matching("kvroute_router_cacheable_prompt_tokens_total"))
    if not found and not cacheable:
        return None
    decisions = "kvroute_router_decisions_total"
    found |= {"cacheable": page.total("kvroute_router_cacheable_prompt_tokens_total")}
    found |= {"decisions": page.total(decisions), DEGRADED: page.total(decisions, policy="degraded")}
    return {key: found.get(key, 0.0) for key in (*REASONS, "cacheable", "decisions", DEGRADED)}


def lost_during(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float] | None:
    """What routers counted between two readings of :func:`lost_from_exposition`."""
    if before is None or after is None:
        return after
    return {key: after[key] - before.get(key, 0.0) for key in after}


def lost_shares(lost: dict[str, float] | None) -> dict[str, float] | None:
    """Each reason's lost tokens as a share of the cacheable tokens (None: not known)."""
    if lost is None or lost.get("cacheable", 0) <= 0:
        return None
    return {reason: round(lost[reason] / lost["cacheable"], 4) for reason in REASONS}


def degraded_share(lost: dict[str, float] | None) -> float | None:
    """The degraded decisions' share of all decisions (None: no decision known)."""
    if lost is None or lost.get("decisions", 0) <= 0:
        return None
    return round(lost.get(DEGRADED, 0.0) / lost["decisions"], 4)


def shares_text(shares: dict[str, float] | None, degraded: float | None = None) -> str:
    """``load/stale/cold`` in percent, as the benchmark tables print it ('n/a' when unknown), and
    the degraded decisions' share where there were any (``, 1.2% degraded``)."""
    if shares is None:
        return "n/a"
    text = "/".join(f"{100 * shares[reason]:.1f}" for reason in REASONS) + "%"
    return f"{text}, {100 * degraded:.1f}% degraded" if degraded else text
