"""The engine's HTTP side as the agent sees it: /health, /metrics (load signal, block size, and
how much work it has done) and /v1/models. Parsing is pure and tested on the real server's
/metrics capture."""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvindex.types import WorkerLoad

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
CACHE_CONFIG = "vllm:cache_config_info"
# Counters that grow as the engine serves requests (so its KV events should be arriving).
WORK_COUNTERS = ("vllm:prompt_tokens_total", "vllm:request_success_total")


@dataclass(frozen=True)
class EngineMetrics:
    load: WorkerLoad | None  # None when the page lacks the load gauges
    block_size: int | None  # from vllm:cache_config_info, when present
    work: float | None = None  # the sum of WORK_COUNTERS; None when the page has neither


def root_url(engine_url: str) -> str:
    """The server's root: routers and the agent append /v1/..., /health, /metrics to it."""
    url = engine_url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def parse_metrics(text: str, dp_rank: int | None = None) -> EngineMetrics:
    """vLLM's Prometheus page -> load and block size. With data parallelism one server labels
    each rank's series ``engine="<rank>"``; only ``dp_rank``'s count (all when None)."""
    sums: dict[str, float] = {}
    seen: set[str] = set()
    block_size: int | None = None
    capacity: int | None = None
    work: float | None = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            engine = sample.labels.get("engine")
            if dp_rank is not None and engine is not None and engine != str(dp_rank):
                continue
            if sample.name in (RUNNING, WAITING, KV_USAGE):
                seen.add(sample.name)
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
            elif sample.name in WORK_COUNTERS:
                work = (work or 0.0) + sample.value
            elif sample.name == CACHE_CONFIG:
                block_size = _int_label(sample.labels, "block_size", block_size)
                capacity = _int_label(sample.labels, "num_gpu_blocks", capacity)
    load = None
    if {RUNNING, WAITING, KV_USAGE} <= seen:
        usage = min(max(sums[KV_USAGE], 0.0), 1.0)
        load = WorkerLoad(int(sums[RUNNING]), int(sums[WAITING]), usage, capacity)
    return EngineMetrics(load, block_size, work)


def _int_label(labels: dict[str, str], name: str, default: int | None) -> int | None:
    value = labels.get(name, "")
    return int(value) if value.isdigit() and int(value) > 0 else default


class EngineClient:
    """HTTP calls to one engine, each bounded by ``timeout_s``."""

    def __init__(self, session: aiohttp.ClientSession, engine_url: str, dp_rank: int, timeout_s: float = 2.0):
        self._session = session
        self.root = root_url(engine_url)
        self._dp_rank = dp_rank
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def healthy(self) -> bool:
        try:
            async with self._session.get(f"{self.root}/health", timeout=self._timeout) as response:
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    async def metrics(self) -> EngineMetrics | None:
        try:
            async with self._session.get(f"{self.root}/metrics", timeout=self._timeout) as response:
                if response.status != 200:
                    return None
                text = await response.text()
        except (aiohttp.ClientError, TimeoutError, OSError):
            return None
        try:
            return parse_metrics(text, self._dp_rank)
        except ValueError:
            return None

    async def served_models(self) -> list[str]:
        try:
            async with self._session.get(f"{self.root}/v1/models", timeout=self._timeout) as response:
                body = await response.json() if response.status == 200 else {}
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
            return []
        data = body.get("data") if isinstance(body, dict) else None
        return [m["id"] for m in data or [] if isinstance(m, dict) and isinstance(m.get("id"), str)]
