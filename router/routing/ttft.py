"""What the router learns online about each worker's time to first token (pure: no I/O).

A worker's TTFT is modelled as ``base + per_token * prefill_tokens + per_context * attention``,
where ``prefill_tokens`` is the prefill work the request waits for on that worker (the uncached
tokens booked there ahead of it plus its own uncached tokens) and ``attention`` that prefill's
attention work (:func:`router.routing.ttft_fit.attention_work`: new tokens after a long context cost more
than cold ones). They are fitted by exponentially weighted least squares (:mod:`router.routing.ttft_fit`)
over the router's own observations (the time from sending a streamed request to its first byte,
with the prefill it was predicted to wait for): ``base`` over the whole fleet, the rates per
worker, shrunk towards the fleet's while a worker has few observations; the fleet's towards a
prior while it has none (``per_context`` 0: time linear in tokens, until contexts vary enough
to tell the term apart).

Requests that are not streamed show their first byte only with their last, so their time is the
whole reply's: prefill wait plus the decode of the reply's tokens. It is fitted on both, the
prefill tokens and the reply's completion tokens (from its usage), so that the decode's share is
learned apart (``decode_per_token_s``) and the prefill rate and base exclude it; whole replies set
the model only while too few streamed requests have been seen (their first bytes measure the
prefill directly). A whole reply whose usage does not say its completion tokens is not learned from.

Three more figures are measured rather than configured:

* ``typical_uncached_tokens``: the uncached tokens of a typical request (what one request the
  engine reports as waiting stands for);
* ``reuse``: the share of prompt tokens the engines report as cached (a block a prefill evicts
  would have been reused with about this probability: the cost of cache pressure);
* ``utilization``: the share of workers with prefill queued when a request arrives (Poisson
  arrivals see time averages, so this is the fleet's prefill utilization): how many later
  requests a prefill added now will delay (:func:`router.routing.scoring.requests_behind`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from router.routing.tier_load import TierLoad, TierLoads, TierLoadSums
from router.routing.tiers import DEFAULT_LOAD_MS_PER_1K
from router.routing.trade_check import UNKNOWN, TradeSums
from router.routing.ttft_fit import PRIOR_PER_TOKEN_S, SUM_FIELDS, Sums, TtftParams

__all__ = ["PRIOR_PER_TOKEN_S", "SUM_FIELDS", "CostModel", "GroupChange", "GroupKey", "TtftLearner", "TtftParams"]

HALF_LIFE = 200.0  # observations after which an old one weighs half
SHRINK = 10.0  # the fleet's fit counts like this many of a worker's own observations
# A worker's learned rate within this share of the typical (median) worker's is taken for the
# fleet's. Equal engines measure different rates by the traffic they get (a busier one batches
# more prefill and looks faster), and a cold prompt then goes to the "fastest" every time: on the
# conversation trace four replicas spread 22.4-26.8k tokens/s over equal engines, and the
# "fastest" took 1.6-1.8x the mean requests (1.08x with the fleet's rate for all;
# docs/benchmarks.md). A slower GPU is further off.
SAME_RATE_WITHIN = 0.25
# ... and a worker's rate is its own only where it stands this many standard errors (its fit's and
# the fleet's together) away from the typical rate, and the fleet's own rate was fitted at all: on
# engines that share CPU cores (or a noisy fleet), whole replies vary by 2-4x with what else runs,
# and a worker that looked twice as fast by chance (or whose fit found a slope where the fleet's,
# lost in the noise, kept its 10k-tokens/s prior) drew every cold prompt and half the traffic
# (issue 55, real vLLM). A slower GPU is away by many errors within a few dozen requests.
RATE_ERRORS = 3.0
UTILIZATION_HALF_LIFE = 100.0  # decisions: a load change shows within a few seconds of traffic
PRIOR_UTILIZATION = 0.5
# Once many observations are held, one more moves the fit by ~1/n: the model is fitted again after
# every n / REFIT_SHARE new ones (every ~4 at the half-life's steady state, each time below ~64),
# not at each decision, where refitting was ~6% of a router's CPU at full rate.
REFIT_SHARE = 64.0
MIN_STREAMED = 5.0  # streamed observations (decayed) before they, not whole replies, set the rate


def _distinct_rates(own: TtftParams, typical: TtftParams, error: float = 0.0) -> TtftParams:
    """A worker's rates (per token and per unit of attention work) with the fleet's base, or the
    typical worker's where its per-token rate is within ``SAME_RATE_WITHIN`` of it or within
    ``RATE_ERRORS`` of its standard ``error`` (:meth:`router.routing.ttft_fit.Sums.rate_error`)."""
    gap = abs(own.per_token_s - typical.per_token_s)
    if gap <= SAME_RATE_WITHIN * typical.per_token_s or gap <= RATE_ERRORS * error:
        return typical
    return TtftParams(typical.base_s, own.per_token_s, own.per_context_s)


def _typical(own_rates: dict[str, TtftParams], fleet: TtftParams) -> TtftParams:
    """The typical worker's rates: the median worker's, and the median attention rate of the
    workers within ``SAME_RATE_WITHIN`` of it. Not the fleet's own fit, which a few slower
    engines (a larger model, an older GPU) pull toward them."""
    if not own_rates:
        return fleet
    median = statistics.median(r.per_token_s for r in own_rates.values())
    alike = [r for r in own_rates.values() if abs(r.per_token_s - median) <= SAME_RATE_WITHIN * median]
    return TtftParams(fleet.base_s, median, statistics.median(r.per_context_s for r in alike or own_rates.values()))


def _blend(own: TtftParams, weight: float, other: TtftParams) -> TtftParams:
    share = weight / (weight + SHRINK)
    return TtftParams(
        share * own.base_s + (1 - share) * other.base_s,
        share * own.per_token_s + (1 - share) * other.per_token_s,
        share * own.per_context_s + (1 - share) * other.per_context_s,
    )


@dataclass
class _Average:
    value: float
    decay: float = 1 - 1 / HALF_LIFE
    since_sync: int = 0

    def add(self, sample: float) -> None:
        self.since_sync += 1
        self.value = self.value * self.decay + sample * (1 - self.decay)

    def vector(self) -> tuple[float, ...]:
        return (self.value,)

    def set_vector(self, values: tuple[float, ...]) -> None:
        (self.value,) = values


# (kind, name): ("a", average), ("S"|"W", "") fleet, ("s"|"w", worker id), ("t", tier) a tier's load,
# ("Q", "") the queue's price (router.routing.trade_check)
GroupKey = tuple[str, str]
_Group = Sums | _Average | TierLoadSums | TradeSums


@dataclass(frozen=True)
class GroupChange:
    """What one group of learned figures gained since it was last shared, as a decayed batch:
    the shared value becomes ``shared * factor + delta``; where the shared value is missing (a
    new worker, a lost hash), ``base``: what this replica last saw of it."""

    key: GroupKey
    factor: float
    delta: tuple[float, ...]
    base: tuple[float, ...]
    count: int  # the observations it holds
    vector: tuple[float, ...]  # the group's value when it was taken


@dataclass(frozen=True)
class CostModel:
    """A snapshot of what was learned, for one decision (scoring reads it, never changes it)."""

    rates: dict[str, TtftParams] = field(default_factory=dict)
    fleet: TtftParams = field(default_factory=TtftParams)
    typical_uncached_tokens: float = 512.0
    reuse: float = 0.5
    utilization: float = PRIOR_UTILIZATION
    # per lower tier, its load cost as learned (router.routing.tier_load; none while not loaded from)
    tier_loads: Mapping[str, TierLoad] = field(default_factory=dict)
    # the price of a queued token against one's own, as the cost uses it (router.routing.trade_check:
    # measured by a learner, 0 until then); 1 here, the full price, for a model built without one
    queue_weight: float = 1.0

    def params(self, worker_id: str) -> TtftParams:
        return self.rates.get(worker_id, self.fleet)

    def tier_load(self, tier: str) -> TierLoad | None:
        """What loading from ``tier`` costs, as learned (None: nothing loaded from it yet)."""
        return self.tier_loads.get(tier)


class TtftLearner:
    def __init__(self, prior: TtftParams | None = None, tier_priors: Mapping[str, float] | None = None) -> None:
        self._prior = prior or TtftParams()
        self._decay = 1 - 1 / HALF_LIFE
        self._workers: dict[str, Sums] = {}
        self._fleet = Sums()
        self._whole_workers: dict[str, Sums] = {}  # whole replies of requests not streamed
        self._whole_fleet = Sums()
        self._typical = _Average(512.0)
        self._reuse = _Average(0.5)
        self._utilization = _Average(PRIOR_UTILIZATION, 1 - 1 / UTILIZATION_HALF_LIFE)
        # the lower tiers' load costs (router.routing.tier_load), learned from --tier-load-ms on
        priors = tier_priors if tier_priors is not None else {t: ms / 1e6 for t, ms in DEFAULT_LOAD_MS_PER_1K.items()}
        self._tier_loads = TierLoads(self._decay, dict(priors))
        self._trades = TradeSums()  # what queues cost, measured (router.routing.trade_check)
        self._queue = UNKNOWN
        self._model = CostModel(queue_weight=self._queue.used)
        # What changed since the model was last built: it is built again when read (once per
        # decision), not at each change. Rates stale: fitted at the next read (a worker forgotten,
        # a sync); observations count in _unfitted, fitted once REFIT_SHARE's share of them came.
        self._rates_stale = self._averages_stale = False
        self._unfitted = 0  # observations since the last fit
        # Each group's value as last shared (router.routing.model_sync); the averages start at their priors.
        self._synced: dict[GroupKey, tuple[float, ...]] = {
            key: group.vector() for key, group in self._groups().items() if key[0] == "a"
        }
        self._shared_keys: set[GroupKey] = set()  # the groups the shared model held at the last sync
        self._lost: set[GroupKey] = set()  # groups it held before and lost since: seeded again

    def observe(
        self,
        worker_id: str,
        prefill_tokens: float,
        seconds: float,
        whole_reply: bool = False,
        completion_tokens: int = 0,
        attention: float = 0.0,
        loaded: tuple[str, float] | None = None,
    ) -> None:
        """A request to ``worker_id`` waited ``seconds`` for its first byte, having been predicted
        to wait for ``prefill_tokens`` of prefill there, of ``attention`` work
        (:func:`router.routing.ttft_fit.attention_work`); ``whole_reply``: it was not streamed, so its
        first byte came with its last, after decoding its ``completion_tokens``. ``loaded``: (tier,
        tokens) it was predicted to load from one lower tier: what teaches that tier's load time
        (router.routing.tier_load)."""
        if seconds < 0 or prefill_tokens < 0 or completion_tokens < 0 or attention < 0:
            return
        if not whole_reply:
            self._tier_loads.observe(prefill_tokens, seconds, attention, loaded)
        workers, fleet = (self._whole_workers, self._whole_fleet) if whole_reply else (self._workers, self._fleet)
        output = completion_tokens if whole_reply else 0
        workers.setdefault(worker_id, Sums()).add(prefill_tokens, seconds, self._decay, output, attention)
        fleet.add(prefill_tokens, seconds, self._decay, output, attention)
        self._unfitted += 1

    def observe_trade(self, own: float, ahead: float, elsewhere: float, output: float, seconds: float) -> None:
        """A reply took ``seconds`` (to its first byte, or whole with ``output`` completion tokens)
        for ``own`` computed prompt tokens, with ``ahead`` tokens of prefill queued ahead of it on
        its worker and ``elsewhere`` on the others (all of it): what measures the queue's price."""
        if min(own, ahead, elsewhere, output, seconds) < 0:
            return
        self._trades.add(own, ahead, elsewhere, output, seconds)
        self._unfitted += 1

    def note_request(self, uncached_tokens: float) -> None:
        self._typical.add(max(uncached_tokens, 0.0))
        self._averages_stale = True

    def note_usage(self, prompt_tokens: int, cached_tokens: int) -> None:
        if prompt_tokens > 0:
            self._reuse.add(min(max(cached_tokens / prompt_tokens, 0.0), 1.0))
            self._averages_stale = True

    def note_busy(self, busy_share: float) -> None:
        """At a decision, ``busy_share`` of the workers had prefill queued."""
        self._utilization.add(min(max(busy_share, 0.0), 1.0))
        self._averages_stale = True

    def _with_averages(self, rates: dict[str, TtftParams], fleet: TtftParams) -> CostModel:
        # against the fleet's coefficients as just fitted (streamed first bytes only: a whole reply
        # holds its decode too)
        tier_loads = self._tier_loads.learned(self._fleet, fleet) if self._rate_source() == "streamed" else {}
        averages = self._typical.value, self._reuse.value, self._utilization.value
        return CostModel(rates, fleet, *averages, tier_loads, queue_weight=self._queue.used)

    def forget(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)
        self._whole_workers.pop(worker_id, None)
        for key in (("s", worker_id), ("w", worker_id)):
            self._synced.pop(key, None)
            self._shared_keys.discard(key)
            self._lost.discard(key)
        self._rates_stale = True

    def worker_ids(self) -> set[str]:
        """The workers something was learned about."""
        return set(self._workers) | set(self._whole_workers)

    def _rate_source(self) -> str:
        """What sets the rate: whole replies while streamed first bytes are too few, else those
        first bytes, else (nothing seen) the prior."""
        if self._fleet.n < MIN_STREAMED and self._whole_fleet.n > self._fleet.n:
            return "whole_replies"
        return "streamed" if self._fleet.n > 0 else "prior"

    def _refit(self) -> None:
        self._rates_stale = self._averages_stale = False
        self._unfitted = 0
        self._queue = self._trades.queue_weight()
        if self._rate_source() == "whole_replies":
            self._refit_from(self._whole_workers, self._whole_fleet)
        else:
            self._refit_from(self._workers, self._fleet)

    def _refit_from(self, workers: dict[str, Sums], sums: Sums) -> None:
        fitted = sums.fit(self._prior)
        fleet = _blend(fitted.params, sums.n, self._prior)
        if sums is self._fleet:
            fleet = self._tier_loads.without_loads(self._fleet, fleet)
        # Per worker only the rate: a per-worker intercept soaks up whatever the model misses
        # (a burst that queued there) and then steers traffic away for good, since a worker that
        # gets no requests gets no observations to correct it. A slower engine shows in its rate.
        own_rates = {w: _blend(own.fit(fleet).params, own.n, fleet) for w, own in workers.items()}
        rates: dict[str, TtftParams] = {}
        if fitted.rate_known:
            # Told apart by more than the worker's error and the typical worker's together; with
            # no rate fitted for the fleet (lost in the noise: its prior stands), no worker's own
            # is told apart from it. Not the fleet fit's error: workers that differ are what
            # widens it, and it would hide the very difference it is there to confirm.
            typical, own_errors = _typical(own_rates, fleet), {w: workers[w].rate_error() for w in own_rates}
            typical_error = statistics.median(own_errors.values()) if own_errors else math.inf
            errors = {w: math.hypot(own_errors[w], typical_error) for w in own_rates}
            rates = {w: _distinct_rates(rate, typical, errors[w]) for w, rate in own_rates.items()}
        self._model = self._with_averages(rates, fleet)

    @property
    def model(self) -> CostModel:
        if self._rates_stale or self._unfitted >= max(1.0, (self._fleet.n + self._whole_fleet.n) / REFIT_SHARE):
            self._refit()
        elif self._averages_stale:
            self._averages_stale = False
            self._model = self._with_averages(self._model.rates, self._model.fleet)
        return self._model

    # --- one model for every replica (router.routing.model_sync shares it through Redis) ------------

    def _fixed_groups(self) -> dict[GroupKey, _Group]:
        return {
            ("a", "typical"): self._typical,
            ("a", "reuse"): self._reuse,
            ("a", "utilization"): self._utilization,
            ("S", ""): self._fleet,
            ("W", ""): self._whole_fleet,
            ("Q", ""): self._trades,
        }

    def _groups(self) -> dict[GroupKey, _Group]:
        groups = self._fixed_groups()
        groups.update({("s", worker): sums for worker, sums in self._workers.items()})
        groups.update({("w", worker): sums for worker, sums in self._whole_workers.items()})
        groups.update({("t", tier): sums for tier, sums in self._tier_loads.sums.items()})
        return groups

    def _group(self, key: GroupKey, fixed: dict[GroupKey, _Group]) -> _Group | None:
        kind, name = key
        if kind in ("s", "w") and name:
            return (self._workers if kind == "s" else self._whole_workers).setdefault(name, Sums())
        if kind == "t" and name:
            return self._tier_loads.sums.setdefault(name, TierLoadSums(self._decay))
        return fixed.get(key)

    def _decay_of(self, group: _Group) -> float:
        return group.decay if isinstance(group, _Average | TierLoadSums | TradeSums) else self._decay

    def changes(self) -> list[GroupChange]:
        """What was learned since the model was last shared (:meth:`adopt`), per group; and the
        groups the shared model lost (its Redis lost the hash), to be seeded again."""
        out = []
        for key, group in self._groups().items():
            if group.since_sync or key in self._lost:
                vector = group.vector()
                base = self._synced.get(key, (0.0,) * len(vector))
                factor = self._decay_of(group) ** group.since_sync
                delta = tuple(v - b * factor for v, b in zip(vector, base, strict=True))
                out.append(GroupChange(key, factor, delta, base, group.since_sync, vector))
        return out

    def adopt(self, sent: Sequence[GroupChange], shared: Mapping[GroupKey, tuple[float, ...]]) -> None:
        """Take the shared model (``shared``: every group's value, ``sent`` folded in) as this
        replica's, with what was learned here since ``sent`` was taken laid on top: each group
        decayed forward past those observations, as if they had come after the shared ones."""
        taken = {change.key: change for change in sent}
        fixed = self._fixed_groups()
        for key, values in shared.items():
            group = self._group(key, fixed)
            if group is None or len(values) != len(group.vector()):
                continue
            change = taken.get(key)
            before = change.vector if change else self._synced.get(key, (0.0,) * len(values))
            since = group.since_sync - (change.count if change else 0)
            factor = self._decay_of(group) ** since
            now = group.vector()
            group.set_vector(tuple(v + factor * (s - b) for v, s, b in zip(now, values, before, strict=True)))
            group.since_sync = since
            self._synced[key] = values
        for key, change in taken.items():
            if key not in shared and (group := self._group(key, fixed)) is not None:
                # Sent and applied, but not read back (a model too large to return): sent is sent.
                group.since_sync -= change.count
                self._synced[key] = change.vector
        self._lost = (self._lost | self._shared_keys) - set(shared) - set(taken)
        self._shared_keys = set(shared) | set(taken)
        self._rates_stale = True

    def snapshot(self) -> dict[str, Any]:
        """What was learned, for an operator (``GET /debug/model``): the fleet's and each worker's
        prefill rate, what set it, and the measured averages."""
        if self._unfitted:
            self._refit()  # every observation so far, for the operator
        model = self.model
        workers = [
            {
                "id": worker_id,
                "prefill_tokens_per_s": _rate(model.params(worker_id)),
                "prefill_context_ns": round(model.params(worker_id).per_context_s * 1e6, 4),
                "observations": round(self._workers[worker_id].n, 1) if worker_id in self._workers else 0.0,
                "whole_reply_observations": round(self._whole_workers[worker_id].n, 1)
                if worker_id in self._whole_workers
                else 0.0,
            }
            for worker_id in sorted(set(model.rates) | set(self._workers) | set(self._whole_workers))
        ]
        return {
            "source": self._rate_source(),
            "base_ms": round(model.fleet.base_s * 1000, 3),
            "prefill_tokens_per_s": _rate(model.fleet),
            "observations": round(self._fleet.n, 1),
            "whole_reply_observations": round(self._whole_fleet.n, 1),
            "decode_ms_per_token": _ms(self._whole_fleet.fit(self._prior).decode_per_token_s),
            # attention's share of prefill: ns per new token per token of context (0: not seen)
            "prefill_context_ns": round(model.fleet.per_context_s * 1e6, 4),
            "typical_uncached_tokens": round(model.typical_uncached_tokens, 1),
            "reuse": round(model.reuse, 4),
            "utilization": round(model.utilization, 4),
            # each lower tier's load cost as learned from TTFTs (router.routing.tier_load): a
            # wait per load and a time per 1k tokens, and the loads it is learned from
            # what a token queued ahead costs against one's own, measured (router.routing.trade_check)
            "queue_weight": {
                "estimate": None if self._queue.estimate is None else round(self._queue.estimate, 4),
                "error": None if self._queue.error is None else round(self._queue.error, 4),
                "used": round(self._queue.used, 4),
                "observations": round(self._queue.observations, 1),
            },
            "tier_loads": {
                tier: {
                    "wait_ms": round(load.wait_s * 1000, 3),
                    "ms_per_1k_tokens": round(load.per_token_s * 1e6, 3),
                    "loads": round(self._tier_loads.sums[tier].n, 1),
                }
                for tier, load in sorted(model.tier_loads.items())
            },
            "workers": workers,
        }


def _ms(seconds: float | None) -> float | None:
    return round(seconds * 1000, 3) if seconds is not None else None


def _rate(params: TtftParams) -> float | None:
    """Prefill tokens per second (None: the fit found no cost per token)."""
    return round(1 / params.per_token_s, 1) if params.per_token_s > 0 else None
