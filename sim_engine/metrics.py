"""vLLM's metric names for the simulated engine: gauges and counters read from the engine at
scrape time, histograms observed as requests progress. Names, help texts, label sets and buckets
are vLLM 0.32's (tests/fixtures/vllm-0.32-cpu/captures/run1_metrics.txt, vllm/v1/metrics)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sim_engine.engine import SimEngine, SimRequest, StepPlan

TIME_TO_FIRST_TOKEN_BUCKETS = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0),
    *(20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
)
REQUEST_LATENCY_BUCKETS = (
    *(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0),
    *(480.0, 960.0, 1920.0, 7680.0),
)
INTER_TOKEN_LATENCY_BUCKETS = (
    *(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0),
    80.0,
)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


class EngineCollector(Collector):
    """The engine's gauges and counters; ``minimal``: the three gauges alone (running, waiting, KV
    usage), what an engine that reports little exports."""

    def __init__(self, engine: SimEngine, labels: dict[str, str], minimal: bool = False) -> None:
        self._engine = engine
        self._labels = labels
        self._minimal = minimal

    def _gauge(self, name: str, help_text: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, help_text, labels=list(self._labels))
        family.add_metric(list(self._labels.values()), value)
        return family

    def _counter(self, name: str, help_text: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, help_text, labels=list(self._labels))
        family.add_metric(list(self._labels.values()), value)
        return family

    def collect(self) -> Iterator[Metric]:
        engine, stats = self._engine, self._engine.stats
        yield self._gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", len(engine.running)
        )
        yield self._gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", engine.num_waiting
        )
        yield self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", engine.pool.usage)
        if self._minimal:
            return
        for name, help_text, value in (
            (
                "prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                stats.prefix_queries,
            ),
            ("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", stats.prefix_hits),
            ("num_preemptions", "Cumulative number of preemption from the engine.", stats.preemptions),
            ("prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens),
            (
                "prompt_tokens_cached",
                "Number of cached prompt tokens (local + external).",
                stats.prompt_tokens_cached,
            ),
            ("generation_tokens", "Number of generation tokens processed.", stats.generation_tokens),
            ("request_success", "Count of successfully processed requests.", stats.requests_finished),
        ):
            yield self._counter(f"vllm:{name}", help_text, value)
        yield self._prompt_tokens_by_source()
        yield self._cache_config_info()

    def _prompt_tokens_by_source(self) -> CounterMetricFamily:
        stats = self._engine.stats
        family = CounterMetricFamily(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            labels=[*self._labels, "source"],
        )
        local = stats.prompt_tokens_cached - stats.prompt_tokens_external
        values = (stats.prompt_tokens - stats.prompt_tokens_cached, local, stats.prompt_tokens_external)
        for source, value in zip(PROMPT_TOKEN_SOURCES, values, strict=True):
            family.add_metric([*self._labels.values(), source], value)
        return family

    def _cache_config_info(self) -> GaugeMetricFamily:
        pool = self._engine.pool
        labels = ["block_size", "enable_prefix_caching", "engine", "num_gpu_blocks", "prefix_caching_hash_algo"]
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=labels)
        values = [str(pool.block_size), "True", self._labels["engine"], str(pool.num_blocks), "sha256"]
        info.add_metric(values, 1.0)
        return info


class SglangCollector(EngineCollector):
    """The gauges and counters SGLang exports, by SGLang's names (sglang 0.5.23's
    srt/observability/metrics_collector.py), for a simulated engine that speaks SGLang: its cache
    in tokens and pages of ``--block-size`` tokens."""

    def collect(self) -> Iterator[Metric]:
        engine, stats, pool = self._engine, self._engine.stats, self._engine.pool
        for name, text, value in (
            ("sglang:num_running_reqs", "The number of running requests.", len(engine.running)),
            ("sglang:num_queue_reqs", "The number of requests in the waiting queue.", engine.num_waiting),
            ("sglang:token_usage", "The token usage.", pool.usage),
            (
                "sglang:max_total_num_tokens",
                "Maximum total number of tokens in the KV cache.",
                pool.num_blocks * pool.block_size,
            ),
            ("sglang:page_size", "The page size of the KV cache.", pool.block_size),
        ):
            yield self._gauge(name, text, value)
        for name, text, value in (
            ("sglang:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens),
            ("sglang:generation_tokens", "Number of generation tokens processed.", stats.generation_tokens),
            ("sglang:cached_tokens", "Number of cached prompt tokens.", stats.prompt_tokens_cached),
            ("sglang:num_requests", "Number of requests processed.", stats.requests_finished),
        ):
            yield self._counter(name, text, value)


@dataclass
class RequestHistograms:
    """vLLM's per-request and per-step histograms: time to first token when the first token is
    delivered, inter-token latency (between the steps that sampled them) for each later one; e2e,
    queue (arrival to first scheduled) and prefill (first scheduled to first token, preemptions
    included) when the request finishes; tokens per engine step."""

    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    queue: Histogram
    prefill: Histogram
    iteration_tokens: Histogram

    @classmethod
    def register(cls, registry: CollectorRegistry, labels: dict[str, str]) -> RequestHistograms:
        def histogram(name: str, help_text: str, buckets: tuple[float, ...]) -> Histogram:
            family = Histogram(name, help_text, list(labels), registry=registry, buckets=buckets)
            return family.labels(**labels)

        return cls(
            histogram(
                "vllm:time_to_first_token_seconds",
                "Histogram of time to first token in seconds.",
                TIME_TO_FIRST_TOKEN_BUCKETS,
            ),
            histogram(
                "vllm:inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.",
                INTER_TOKEN_LATENCY_BUCKETS,
            ),
            histogram(
                "vllm:e2e_request_latency_seconds",
                "Histogram of e2e request latency in seconds.",
                REQUEST_LATENCY_BUCKETS,
            ),
            histogram(
                "vllm:request_queue_time_seconds",
                "Histogram of time spent in WAITING phase for request.",
                REQUEST_LATENCY_BUCKETS,
            ),
            histogram(
                "vllm:request_prefill_time_seconds",
                "Histogram of time spent in PREFILL phase for request.",
                REQUEST_LATENCY_BUCKETS,
            ),
            histogram(
                "vllm:iteration_tokens_total",
                "Histogram of number of tokens per engine_step.",
                ITERATION_TOKENS_BUCKETS,
            ),
        )

    def token(self, request: SimRequest, index: int) -> None:
        """Output token ``index`` (0: the first) was delivered."""
        if index == 0 and request.first_token_at is not None:
            self.ttft.observe(request.first_token_at - request.arrived)
        elif 0 < index < len(request.token_times):
            self.itl.observe(request.token_times[index] - request.token_times[index - 1])

    def finished(self, request: SimRequest, now: float) -> None:
        self.e2e.observe((request.finished_at or now) - request.arrived)
        if request.scheduled_at is not None:
            self.queue.observe(request.scheduled_at - request.arrived)
            if request.first_token_at is not None:
                self.prefill.observe(request.first_token_at - request.scheduled_at)

    def step(self, plan: StepPlan) -> None:
        if plan.scheduled:
            self.iteration_tokens.observe(plan.num_tokens)
