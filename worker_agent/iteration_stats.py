"""TensorRT-LLM's load, from trtllm-serve's ``GET /metrics``: a JSON list of the iteration stats
queued since the last read (drained by each read), each as the executor writes them::

    {"iter": 12, "numActiveRequests": 2, "numQueuedRequests": 1,
     "inflightBatchingStats": {"numPausedRequests": 0, ...},
     "kvCacheStats": {"maxNumBlocks": 1000, "freeNumBlocks": 600, "usedNumBlocks": 400,
                      "tokensPerBlock": 32, ...}, ...}

The latest iteration says the load: running = active requests, waiting = queued + paused, KV usage
= used / max blocks, capacity = max blocks x tokens per block in the index's blocks. An empty list
(no iteration since the last read) is an idle engine: nothing running or waiting, its usage as
last read. trtllm-serve exports no counters of its work on this page: the agent counts the
iterations and completed requests it reads (:func:`work_done`) as its events watch's work
(worker_agent/events.py), so an idle engine, which runs none, raises no alarm.
"""

from __future__ import annotations

import math
from typing import Any

from kvindex.types import WorkerLoad


def _count(value: Any) -> int | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
    return int(value) if ok else None


def work_done(body: list[Any]) -> tuple[int, int]:
    """(iterations, requests completed) in a list of iteration stats."""
    completed = (_count(stats.get("numCompletedRequests")) if isinstance(stats, dict) else None for stats in body)
    return len(body), sum(count or 0 for count in completed)


def parse_iteration_stats(body: Any, block_size: int | None, last_usage: float = 0.0) -> tuple[WorkerLoad | None, str]:
    """The stats list -> (the load, ""), or (None, what is wrong with it)."""
    if not isinstance(body, list):
        return None, "not a JSON list of iteration stats"
    if not body:
        return WorkerLoad(0, 0, last_usage), ""
    latest = body[-1] if isinstance(body[-1], dict) else {}
    running, queued = _count(latest.get("numActiveRequests")), _count(latest.get("numQueuedRequests"))
    batching = latest.get("inflightBatchingStats")
    paused = _count(batching.get("numPausedRequests", 0)) if isinstance(batching, dict) else 0
    if running is None or queued is None or paused is None:
        return None, "numActiveRequests or numQueuedRequests missing or not a count"
    stats = latest.get("kvCacheStats")
    kv: dict[str, Any] = stats if isinstance(stats, dict) else {}
    total, used = _count(kv.get("maxNumBlocks")), _count(kv.get("usedNumBlocks"))
    usage = min(used / total, 1.0) if total and used is not None else last_usage
    per_block = _count(kv.get("tokensPerBlock"))
    capacity = (total * per_block) // block_size or None if total and per_block and block_size else None
    return WorkerLoad(running, queued + paused, usage, capacity), ""
