"""Decision-quality accounting: why a request's prompt was not served from cache.

Per routed request (docs/dashboard.md has the definitions and why):

- ``P`` prompt tokens; ``cacheable``: what could be served from cache at all, counted as vLLM
  counts cached tokens (whole blocks, at most ``P - 1``), the rounding the decision uses;
- ``B`` the best match: the most cached tokens any alive candidate worker was predicted to hold;
- ``C`` the chosen worker's predicted cached tokens;
- ``R`` the engine's reported cached tokens (``usage.prompt_tokens_details.cached_tokens``), or
  unknown.

The prefix tokens lost split three ways: ``load_tradeoff = B - C`` (a better-matching worker
existed: the router traded hits for load), ``stale_index = max(0, C - R)`` (the index promised
more than the engine had; unknown without R) and ``cold = cacheable - B`` (no worker had it).
When the engine had more than predicted, ``unpredicted = max(0, R - C)``; then
``cacheable - R = cold + load_tradeoff + stale_index - unpredicted``.

*Regret* judges the choice afterwards: a request regrets its worker when another alive worker
was predicted to hold more of its prompt (``O``, the best of the others) than the chosen engine
reported serving from cache (``O > R``), by ``O - R`` tokens. A routing that loses (stale
predictions, needless moves) shows as a rising share of regretted requests, whatever the
workload's own cold share.

Everything here is pure (time is passed in), so that the rules are unit-tested on their own.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields

from router.routing.decision import Decision, hit_blocks
from router.routing.expectations import checkpoints
from router.routing.scoring import Candidate, predicted_cached_tokens

REASONS = ("load_tradeoff", "stale_index", "cold")
DEGRADED = "degraded_decisions"  # decisions made without Redis (round robin)
BUCKET_S = 10.0  # the rolling window's resolution
WINDOW_BUCKETS = 30  # 5 minutes: "the last minutes" on the dashboard
PREFIX_TABLE_LIMIT = 1024  # prefixes remembered for the dashboard's "most shared" table


@dataclass(frozen=True)
class Split:
    """One request's accounting, in tokens; ``reported`` and ``stale`` are None when the engine
    did not report cached tokens."""

    prompt_tokens: int
    cacheable: int
    best_match: int
    chosen_match: int
    reported: int | None
    lost_load: int
    lost_stale: int | None
    cold: int
    unpredicted: int | None
    best_other: int = 0  # O: the most cached tokens any other alive worker was predicted to hold

    @property
    def regret(self) -> int | None:
        """Tokens another worker was predicted to hold beyond what the chosen engine served from
        cache (0: no regret); None when the engine did not report."""
        return None if self.reported is None else max(0, self.best_other - self.reported)

    def lost(self) -> dict[str, int]:
        """The lost tokens by reason (stale counts 0 while unknown)."""
        return {"load_tradeoff": self.lost_load, "stale_index": self.lost_stale or 0, "cold": self.cold}

    def log_fields(self) -> dict[str, int | None]:
        """The access log's and /debug/route's fields."""
        return {
            "best_match_tokens": self.best_match,
            "lost_load_tokens": self.lost_load,
            "lost_stale_tokens": self.lost_stale,
            "cold_tokens": self.cold,
        }


def split(
    prompt_tokens: int,
    block_size: int,
    prompt_blocks: int,
    matched_blocks: Iterable[int],
    chosen_blocks: int,
    reported: int | None = None,
    other_blocks: Iterable[int] = (),
) -> Split:
    """The accounting of one decision: ``matched_blocks`` of every alive candidate (the chosen one
    included), ``chosen_blocks`` the chosen worker's, ``reported`` the engine's cached tokens,
    ``other_blocks`` the other candidates' (for regret)."""

    def tokens(blocks: int) -> int:
        return predicted_cached_tokens(min(blocks, prompt_blocks), prompt_tokens, block_size)

    cacheable = tokens(prompt_blocks)
    chosen = tokens(chosen_blocks)
    best = max([chosen, *(tokens(b) for b in matched_blocks)])
    best_other = max((tokens(b) for b in other_blocks), default=0)
    stale = unpredicted = None
    if reported is not None:
        reported = max(0, reported)
        stale, unpredicted = max(0, chosen - reported), max(0, reported - chosen)
    lost_load, cold = best - chosen, cacheable - best
    return Split(prompt_tokens, cacheable, best, chosen, reported, lost_load, stale, cold, unpredicted, best_other)


@dataclass
class Bucket:
    """Sums over one slice of time. ``reported_*`` and ``lost_stale`` only count requests whose
    engine reported cached tokens, so that hit rate and prediction compare like with like."""

    decisions: int = 0  # every decision (degraded ones too)
    degraded: int = 0
    accounted: int = 0  # requests proxied with an index decision (their split is known)
    prompt_tokens: int = 0
    cacheable: int = 0
    best_match: int = 0
    chosen_match: int = 0
    lost_load: int = 0
    cold: int = 0
    reported_requests: int = 0
    reported_prompt_tokens: int = 0
    reported_cached: int = 0
    reported_predicted: int = 0
    lost_stale: int = 0
    unpredicted: int = 0
    regretted: int = 0  # reported requests another worker was predicted to serve better
    regret_tokens: int = 0

    def add_split(self, s: Split) -> None:
        self.accounted += 1
        self.prompt_tokens += s.prompt_tokens
        self.cacheable += s.cacheable
        self.best_match += s.best_match
        self.chosen_match += s.chosen_match
        self.lost_load += s.lost_load
        self.cold += s.cold
        if s.reported is not None:
            self.reported_requests += 1
            self.reported_prompt_tokens += s.prompt_tokens
            self.reported_cached += s.reported
            self.reported_predicted += s.chosen_match
            self.lost_stale += s.lost_stale or 0
            self.unpredicted += s.unpredicted or 0
            self.regretted += int(bool(s.regret))
            self.regret_tokens += s.regret or 0

    def merge(self, other: Bucket) -> None:
        for item in fields(self):
            setattr(self, item.name, getattr(self, item.name) + getattr(other, item.name))


def _share(part: int, whole: int) -> float | None:
    return None if whole <= 0 else round(part / whole, 4)


def summary(bucket: Bucket, seconds: float) -> dict[str, object]:
    """A bucket's sums with the rates the dashboard shows: hit rate (reported cached / prompt
    tokens), each reason's share of the cacheable tokens, decisions per second."""
    return {
        **asdict(bucket),
        "hit_rate": _share(bucket.reported_cached, bucket.reported_prompt_tokens),
        "predicted_hit_rate": _share(bucket.reported_predicted, bucket.reported_prompt_tokens),
        "lost_share": {
            "load_tradeoff": _share(bucket.lost_load, bucket.cacheable),
            "stale_index": _share(bucket.lost_stale, bucket.cacheable),
            "cold": _share(bucket.cold, bucket.cacheable),
        },
        "decisions_per_s": round(bucket.decisions / seconds, 3) if seconds > 0 else None,
        # of the requests whose engine reported, those another worker was predicted to serve better
        "regret_share": _share(bucket.regretted, bucket.reported_requests),
    }


@dataclass
class RollingWindow:
    """The last ``buckets`` x ``bucket_s`` seconds, in buckets; ``now`` is a monotonic time."""

    bucket_s: float = BUCKET_S
    buckets: int = WINDOW_BUCKETS
    _slots: OrderedDict[int, Bucket] = field(default_factory=OrderedDict)
    # the same splits per role of the worker they were charged to (a prefill/decode fleet's
    # prefill, decode and both workers: kvindex/roles.py)
    by_role: dict[str, RollingWindow] = field(default_factory=dict)

    def _bucket(self, now: float) -> Bucket:
        slot = int(now // self.bucket_s)
        self._expire(slot)
        if slot not in self._slots:
            self._slots[slot] = Bucket()
        return self._slots[slot]

    def _expire(self, slot: int) -> None:
        while self._slots and next(iter(self._slots)) <= slot - self.buckets:
            self._slots.popitem(last=False)

    def note_decision(self, now: float, degraded: bool) -> None:
        bucket = self._bucket(now)
        bucket.decisions += 1
        bucket.degraded += int(degraded)

    def note_split(self, now: float, s: Split, role: str | None = None) -> None:
        self._bucket(now).add_split(s)
        if role is not None:
            self.by_role.setdefault(role, RollingWindow(self.bucket_s, self.buckets)).note_split(now, s)

    def series(self, now: float) -> list[tuple[float, Bucket]]:
        """Every bucket of the window, oldest first, empty ones included: (seconds ago its slice
        started, its sums)."""
        current = int(now // self.bucket_s)
        self._expire(current)
        return [
            (round(now - slot * self.bucket_s, 3), self._slots.get(slot, Bucket()))
            for slot in range(current - self.buckets + 1, current + 1)
        ]

    def total(self, now: float, last_s: float | None = None) -> tuple[Bucket, float]:
        """The sums over the last ``last_s`` seconds (whole buckets; default the whole window)
        and the seconds they cover (a bucket under way counts for the part elapsed)."""
        span = self.buckets if last_s is None else max(1, min(self.buckets, round(last_s / self.bucket_s)))
        out = Bucket()
        for _, bucket in self.series(now)[-span:]:
            out.merge(bucket)
        seconds = (span - 1) * self.bucket_s + (now % self.bucket_s)
        return out, seconds


@dataclass
class PrefixStats:
    model: str
    block_hash: int
    tokens: int  # the prefix's length
    holders: int  # alive workers that held it at its last sighting
    hits: int = 0
    last_seen: float = 0.0


class SharedPrefixes:
    """The prefixes requests found cached, for the dashboard: per request, the deepest checkpoint
    (a power of two of blocks, or the whole prompt) that the best-matching worker held, how many
    workers held it and how often it was hit. Bounded: the least recently seen goes first."""

    def __init__(self, limit: int = PREFIX_TABLE_LIMIT) -> None:
        self._limit = limit
        self._table: OrderedDict[tuple[str, int], PrefixStats] = OrderedDict()

    def note(self, model: str, block_hash: int, tokens: int, holders: int, now: float) -> None:
        key = (model, block_hash)
        stats = self._table.pop(key, None) or PrefixStats(model, block_hash, tokens, holders)
        stats.hits += 1
        stats.holders, stats.last_seen = holders, now
        self._table[key] = stats
        while len(self._table) > self._limit:
            self._table.popitem(last=False)

    def top(self, count: int, now: float) -> list[dict[str, object]]:
        """The ``count`` most hit prefixes (then the longest), as the dashboard shows them."""
        ranked = sorted(self._table.values(), key=lambda p: (-p.hits, -p.tokens, p.block_hash))[:count]
        return [
            {
                "model": p.model,
                "hash": f"{p.block_hash & (2**64 - 1):016x}"[:12],
                "tokens": p.tokens,
                "holders": p.holders,
                "hits": p.hits,
                "last_seen_s_ago": round(max(0.0, now - p.last_seen), 1),
            }
            for p in ranked
        ]

    def __len__(self) -> int:
        return len(self._table)


def lost_split(decision: Decision, candidate: Candidate | None = None, reported: int | None = None) -> Split | None:
    """Why the decision's prompt prefix was or was not cached on ``candidate`` (default the chosen
    worker), given the engine's ``reported`` cached tokens. None for a degraded decision: the
    index was not read, so no match is known."""
    if decision.degraded:
        return None
    chosen = candidate or decision.choice.chosen
    hits = [s.hit_blocks for s in decision.choice.ranked]
    others = [s.hit_blocks for s in decision.choice.ranked if s.candidate.worker_id != chosen.worker_id]
    blocks = decision.prompt_tokens, decision.block_size, decision.prompt_blocks
    return split(*blocks, hits, hit_blocks(decision, chosen), reported, others)


def shared_prefix(decision: Decision) -> tuple[int, int, int] | None:
    """(block hash, tokens, holders) of the deepest checkpoint of the prompt that the
    best-matching worker held, and how many alive workers held it; None when none did."""
    matched = [min(s.candidate.matched_blocks, decision.prompt_blocks) for s in decision.choice.ranked]
    best = max(matched, default=0)
    if decision.degraded or best <= 0:
        return None
    depth = max(d for d in checkpoints(decision.prompt_blocks) if d <= best)
    return decision.chain[depth - 1], depth * decision.block_size, sum(1 for m in matched if m >= depth)
