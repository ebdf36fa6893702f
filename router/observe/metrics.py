"""The router's Prometheus metrics (one registry per app) and the usage it reads from replies."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from router.prompts.hashing import PromptHasher
from router.prompts.token_cache import TokenCache
from router.routing.accounting import REASONS
from router.routing.lookups import Lookups
from router.routing.model_sync import SyncStatus
from router.upstream.pool import UpstreamPool

PREFIX = "kvroute_router_"


@dataclass
class RouterMetrics:
    registry: CollectorRegistry
    requests: Counter
    decisions: Counter
    decision_seconds: Histogram
    degraded: Counter
    degraded_causes: Counter
    retries: Counter
    upstream_errors: Counter
    split_requests: Counter
    prompt_tokens: Counter
    cached_tokens: Counter
    loaded_tokens: Counter
    predicted_cached_tokens: Counter
    predictions: Counter
    prediction_error_tokens: Histogram
    inflight: Gauge
    degraded_mode: Gauge
    admitted: Gauge
    handovers: Counter
    lost_prefix_tokens: Counter
    cacheable_tokens: Counter
    best_match_tokens: Counter
    alive_workers: Gauge
    regretted_requests: Counter
    regret_tokens: Counter
    regret_ratio: Gauge
    queue_weight: Gauge


def new_metrics(state: StateCollector | None = None) -> RouterMetrics:
    r = CollectorRegistry()
    if state is not None:
        r.register(state)
    metrics = RouterMetrics(
        registry=r,
        requests=Counter(PREFIX + "requests", "Requests by endpoint and status", ["endpoint", "status"], registry=r),
        decisions=Counter(PREFIX + "decisions", "Decisions per worker", ["model", "worker", "policy"], registry=r),
        decision_seconds=Histogram(
            PREFIX + "decision_seconds",
            "Time to decide (tokenization excluded)",
            buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1),
            registry=r,
        ),
        degraded=Counter(PREFIX + "degraded_decisions", "Decisions made without Redis (local round robin)", registry=r),
        degraded_causes=Counter(
            PREFIX + "degraded_causes",
            "Degraded decisions by cause: budget (no reply in time), busy (no lookup slot in time), error",
            ["cause"],
            registry=r,
        ),
        retries=Counter(PREFIX + "upstream_retries", "Requests retried on the next best worker", registry=r),
        upstream_errors=Counter(PREFIX + "upstream_errors", "Failures before the first byte", ["worker"], registry=r),
        split_requests=Counter(
            PREFIX + "split_requests", "Requests split over a prefill and a decode worker", ["model"], registry=r
        ),
        prompt_tokens=Counter(PREFIX + "prompt_tokens", "Prompt tokens the engines reported", ["model"], registry=r),
        loaded_tokens=Counter(
            PREFIX + "loaded_prefix_tokens",
            "Prompt tokens the chosen workers were predicted to load from a lower cache tier, by tier",
            ["model", "tier"],
            registry=r,
        ),
        cached_tokens=Counter(
            PREFIX + "cached_tokens",
            "Cached prompt tokens the engines reported (hit rate = cached_tokens / prompt_tokens)",
            ["model"],
            registry=r,
        ),
        predicted_cached_tokens=Counter(
            PREFIX + "predicted_cached_tokens",
            "Cached tokens the router predicted, for requests whose reply reported cached tokens",
            ["model"],
            registry=r,
        ),
        predictions=Counter(PREFIX + "predictions", "Predicted vs reported", ["model", "outcome"], registry=r),
        prediction_error_tokens=Histogram(
            PREFIX + "prediction_error_tokens",
            "|predicted - reported| cached tokens",
            buckets=(0, 16, 64, 256, 1024, 4096, 16384),
            registry=r,
        ),
        inflight=Gauge(PREFIX + "inflight_requests", "Requests this replica is proxying", registry=r),
        degraded_mode=Gauge(PREFIX + "degraded_mode", "1 while this replica routes without Redis", registry=r),
        admitted=Gauge(
            PREFIX + "admitted_requests",
            "Requests under /v1/ and /debug/ being handled, body reads included (limit: --max-inflight)",
            registry=r,
        ),
        handovers=Counter(
            PREFIX + "http_handovers",
            "Always 0 since the router serves every endpoint on one HTTP server (kept so that dashboards "
            "reading it do not break): were client connections handed from the lean front to aiohttp's",
            registry=r,
        ),
        lost_prefix_tokens=Counter(
            PREFIX + "lost_prefix_tokens",
            "Cacheable prompt tokens not served from cache, by reason: load_tradeoff (a better-matching worker "
            "existed), stale_index (predicted more than the engine had), cold (no worker had them)",
            ["reason"],
            registry=r,
        ),
        cacheable_tokens=Counter(
            PREFIX + "cacheable_prompt_tokens",
            "Prompt tokens that could be served from cache at all (whole blocks, at most prompt - 1), "
            "of requests routed with the index",
            ["model"],
            registry=r,
        ),
        best_match_tokens=Counter(
            PREFIX + "best_match_tokens",
            "The best predicted cached tokens any alive worker had, of requests routed with the index",
            ["model"],
            registry=r,
        ),
        regretted_requests=Counter(
            PREFIX + "regretted_requests",
            "Requests routed with the index whose engine served fewer cached tokens than another alive worker "
            "was predicted to hold (regret: the choice was, afterwards, not the best)",
            ["model"],
            registry=r,
        ),
        regret_tokens=Counter(
            PREFIX + "regret_tokens",
            "The prompt tokens of regretted requests another worker was predicted to hold beyond what "
            "the chosen engine served from cache",
            ["model"],
            registry=r,
        ),
        regret_ratio=Gauge(
            PREFIX + "regret_ratio",
            "Of the last 5 minutes' requests whose engine reported cached tokens, the share regretted "
            "(read at scrape time; 0 when none reported)",
            registry=r,
        ),
        queue_weight=Gauge(
            PREFIX + "queue_weight",
            "What a token of prefill queued ahead on a worker costs a request against a token of its own, "
            "as measured on this fleet and used by the cost (1: a queue costs in full; 0: moving off the "
            "longest prefix to a shorter queue saves nothing; router/routing/trade_check.py), per model",
            ["model"],
            registry=r,
        ),
        alive_workers=Gauge(
            PREFIX + "alive_workers",
            "Workers this replica routes to, per model it has served (0: none alive; retained ones count)",
            ["model"],
            registry=r,
        ),
    )
    for reason in REASONS:  # every reason exported from the start (at 0): alerts and dashboards need the series
        metrics.lost_prefix_tokens.labels(reason)
    return metrics


class StateCollector(Collector):
    """The decision lookups', the prompt hasher's and the tokenize cache's state, read at scrape time."""

    def __init__(
        self,
        lookups: Lookups,
        hasher: PromptHasher,
        cache: TokenCache,
        upstream: UpstreamPool | None = None,
        model_sync: SyncStatus | None = None,
    ) -> None:
        self._lookups, self._hasher, self._cache = lookups, hasher, cache
        self._upstream = upstream
        self._model_sync = model_sync or SyncStatus(enabled=False)

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        yield GaugeMetricFamily(
            PREFIX + "prompts_hashing", "Long prompts being hashed in slices now", value=self._hasher.in_progress
        )
        yield CounterMetricFamily(
            PREFIX + "prompts_sliced", "Prompts hashed in slices (long ones)", value=self._hasher.sliced
        )
        yield GaugeMetricFamily(
            PREFIX + "tokenize_cache_tokens", "Token ids held by the /tokenize cache", value=self._cache.tokens
        )
        late = self._lookups.late_replies
        yield CounterMetricFamily(
            PREFIX + "redis_late_replies", "Decision lookups answered after their budget (discarded)", value=late
        )
        yield GaugeMetricFamily(
            PREFIX + "redis_lookups_inflight", "Decision lookups waiting for Redis now", value=self._lookups.in_flight
        )
        yield GaugeMetricFamily(
            PREFIX + "upstream_queued",
            "Requests waiting for a connection to a worker (--upstream-connections[-per-worker] reached)",
            value=self._upstream.queued if self._upstream is not None else 0,
        )
        yield GaugeMetricFamily(
            PREFIX + "redis_lookup_slots", "Decision lookups that may wait for Redis at once", value=self._lookups.slots
        )
        yield CounterMetricFamily(
            PREFIX + "model_syncs",
            "Learned cost models shared with the other replicas through Redis (--model-sync-ms)",
            value=self._model_sync.syncs,
        )
        yield CounterMetricFamily(
            PREFIX + "model_sync_failures",
            "Rounds of sharing the learned cost model that Redis did not take (each replica learned alone meanwhile)",
            value=self._model_sync.failures,
        )
