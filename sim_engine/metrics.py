"""vLLM's metric names for the simulated engine, read from the engine at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sim_engine.engine import SimEngine


class EngineCollector(Collector):
    def __init__(self, engine: SimEngine, labels: dict[str, str]) -> None:
        self._engine = engine
        self._labels = labels

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
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", len(engine.waiting)
        )
        yield self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", engine.pool.usage)
        for name, help_text, value in (
            (
                "prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                stats.prefix_queries,
            ),
            ("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", stats.prefix_hits),
            ("prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens),
            ("generation_tokens", "Number of generation tokens processed.", stats.generation_tokens),
            ("num_preemptions", "Cumulative number of preemption from the engine.", stats.preemptions),
            ("request_success", "Count of successfully processed requests.", stats.requests_finished),
        ):
            yield self._counter(f"vllm:{name}", help_text, value)
        yield self._cache_config_info()

    def _cache_config_info(self) -> GaugeMetricFamily:
        pool = self._engine.pool
        labels = ["block_size", "enable_prefix_caching", "engine", "num_gpu_blocks", "prefix_caching_hash_algo"]
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=labels)
        values = [str(pool.block_size), "True", self._labels["engine"], str(pool.num_blocks), "sha256"]
        info.add_metric(values, 1.0)
        return info
