"""What the agent reads from each kind of engine (``--engine-kind``): its KV-event dialect, whether
its blocks are pages to re-block into the index's, and the names of its Prometheus metrics.

* ``vllm``: kvevents/vllm.py; blocks are the index's; ``vllm:`` metrics, ranks labelled ``engine``.
* ``sglang``: kvevents/sglang.py; blocks are radix-cache pages (worker_agent/pages.py); ``sglang:``
  metrics, ranks labelled ``dp_rank``; the cache's size in tokens (``sglang:max_total_num_tokens``).
* ``trtllm``: kvevents/trtllm.py, fetched from ``POST /kv_cache_events`` (worker_agent/poller.py);
  blocks re-blocked as SGLang's pages; load from the JSON iteration stats of ``GET /metrics``
  (worker_agent/iteration_stats.py).

An engine that does not say which it is is taken for vLLM; :func:`kind_of_listing` reads the
``owned_by`` of the models an engine lists (vLLM says ``vllm``, SGLang ``sglang``, trtllm-serve
``tensorrt_llm``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from kvevents import sglang, trtllm, vllm
from kvevents.events import EventBatch

VLLM: Final = "vllm"
SGLANG: Final = "sglang"
TRTLLM: Final = "trtllm"
ENGINE_KINDS: Final = (VLLM, SGLANG, TRTLLM)
_OWNERS: Final = {VLLM: VLLM, SGLANG: SGLANG, "tensorrt_llm": TRTLLM, TRTLLM: TRTLLM}
# The index's block size for an engine whose pages are not blocks, unless --block-size says
# otherwise: vLLM's default block size, so a fleet that mixes engines agrees on it.
PAGED_DEFAULT_BLOCK_SIZE: Final = 16


@dataclass(frozen=True)
class MetricNames:
    """The engine's names for what the agent reads from its /metrics."""

    running: str
    waiting: str
    kv_usage: str  # the share of the KV cache in use, 0..1
    prompt_tokens: str  # counters: what the engine has done, and what it computed rather than found
    finished: str
    cached_tokens: str
    generated_tokens: str
    rank_label: str  # the label naming a data-parallel rank's series
    cache_config: str | None = None  # vLLM's info metric (labels block_size, num_gpu_blocks)
    capacity_tokens: str | None = None  # the KV cache's size in tokens (SGLang)
    start_time: str = "process_start_time_seconds"  # a new value is a new process
    # What says the engine has worked, beside the finished requests: its prompt-token counter,
    # unless it has none and names another (TensorRT-LLM: the iterations the agent counts).
    work_counter: str | None = None

    @property
    def progress(self) -> str:
        return self.work_counter or self.prompt_tokens

    @property
    def load(self) -> tuple[str, str, str]:
        return self.running, self.waiting, self.kv_usage

    @property
    def counters(self) -> tuple[str, str, str, str]:
        return self.prompt_tokens, self.finished, self.cached_tokens, self.generated_tokens

    @property
    def read(self) -> tuple[str, ...]:
        optional = tuple(name for name in (self.cache_config, self.capacity_tokens) if name is not None)
        return (*self.load, *optional, self.start_time, *self.counters)


VLLM_METRICS: Final = MetricNames(
    running="vllm:num_requests_running",
    waiting="vllm:num_requests_waiting",
    kv_usage="vllm:kv_cache_usage_perc",
    prompt_tokens="vllm:prompt_tokens_total",
    finished="vllm:request_success_total",
    cached_tokens="vllm:prompt_tokens_cached_total",
    generated_tokens="vllm:generation_tokens_total",
    rank_label="engine",
    cache_config="vllm:cache_config_info",
)
SGLANG_METRICS: Final = MetricNames(
    running="sglang:num_running_reqs",
    waiting="sglang:num_queue_reqs",
    kv_usage="sglang:token_usage",
    prompt_tokens="sglang:prompt_tokens_total",
    finished="sglang:num_requests_total",
    cached_tokens="sglang:cached_tokens_total",
    generated_tokens="sglang:generation_tokens_total",
    rank_label="dp_rank",
    capacity_tokens="sglang:max_total_num_tokens",
)

# TensorRT-LLM's JSON iteration stats (worker_agent/iteration_stats.py) have no Prometheus names:
# the agent counts the iterations and completed requests it reads, under these names, so that its
# events watch sees the engine working (an idle engine runs no iteration).
TRTLLM_METRICS: Final = MetricNames(
    running="numActiveRequests",
    waiting="numQueuedRequests",
    kv_usage="kvCacheStats",
    prompt_tokens="",  # its stats count no prompt tokens
    work_counter="iterations",
    finished="numCompletedRequests",
    cached_tokens="",
    generated_tokens="",
    rank_label="attention_dp_rank",
)


@dataclass(frozen=True)
class EngineKind:
    name: str
    decode: Callable[[list[bytes], str], EventBatch]  # (frames, the topic a reply may leave out)
    paged: bool  # its blocks are pages, re-blocked into the index's (worker_agent/pages.py)
    metrics: MetricNames  # its Prometheus names (TensorRT-LLM: what the agent counts)
    polled: bool = False  # its events are fetched over HTTP (POST /kv_cache_events), not pushed over ZMQ
    iteration_stats: bool = False  # its load is JSON iteration stats on GET /metrics


def _decode_vllm(frames: list[bytes], topic: str) -> EventBatch:
    return vllm.decode_message(frames)


KINDS: Final = {
    VLLM: EngineKind(VLLM, _decode_vllm, False, VLLM_METRICS),
    SGLANG: EngineKind(SGLANG, sglang.decode_message, True, SGLANG_METRICS),
    TRTLLM: EngineKind(TRTLLM, trtllm.decode_message, True, TRTLLM_METRICS, polled=True, iteration_stats=True),
}


def chosen(flag: str | None, listed: str | None) -> tuple[EngineKind, str]:
    """The kind to read an engine as: --engine-kind's, else its listing's, else vLLM; and why."""
    if flag is not None:
        return KINDS[flag], "--engine-kind"
    if listed is not None:
        return KINDS[listed], "its /v1/models"
    return KINDS[VLLM], "the default"


def kind_of_listing(body: object) -> str | None:
    """The engine kind a /v1/models listing names in its entries' ``owned_by`` (None: none known)."""
    data = body.get("data") if isinstance(body, dict) else None
    for entry in data if isinstance(data, list) else []:
        owner = entry.get("owned_by") if isinstance(entry, dict) else None
        if isinstance(owner, str) and owner.lower() in _OWNERS:
            return _OWNERS[owner.lower()]
    return None
