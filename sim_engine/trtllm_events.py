"""The engine side of TensorRT-LLM's KV events, for a simulated engine started with
``--engine-kind trtllm``: a bounded queue of events that ``POST /kv_cache_events`` drains, as
trtllm-serve's (kvevents/trtllm.py says their shape).

The engine's batches become TensorRT-LLM events one by one, numbered from 0 per process; event 0
is ``created`` (an empty cache), and so is a prefix-cache reset (TensorRT-LLM has no event for
one). A full queue drops its oldest events (``event_buffer_max_size``), which the consumer sees
as a gap in the event ids. Only the GPU tier, no LoRA names and no salts: TensorRT-LLM's events
say none of them (the settings refuse the CPU and disk tiers with this kind).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

from kvevents import trtllm
from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored, Event
from sim_engine.engine import SimEngine

# owned_by in /v1/models, by engine kind (trtllm-serve's ModelCard says tensorrt_llm)
OWNERS = {"vllm": "vllm", "sglang": "sglang", "trtllm": "tensorrt_llm"}


class TrtllmEventQueue:
    """What a KVEventPublisher does for vLLM and SGLang, over HTTP: the engine publishes into it,
    the consumer drains it."""

    def __init__(self, num_blocks: int, max_events: int = 10_000) -> None:
        self._queue: deque[dict[str, Any]] = deque(maxlen=max_events)
        self._next_id = 0
        self._num_blocks = num_blocks
        self._steps_read = self._finished_read = 0  # the engine's counts at the last GET /metrics
        self.endpoint: str | None = None  # no socket: the events are fetched over HTTP
        self.replay_endpoint: str | None = None
        self._created()

    @property
    def next_seq(self) -> int:
        """The id the next event gets."""
        return self._next_id

    def _created(self) -> None:
        self._add(trtllm.created_json(self._next_id, [self._num_blocks, 0]))

    def _add(self, event: dict[str, Any], deliver: bool = True) -> None:
        if deliver:
            self._queue.append(event)
        self._next_id += 1

    async def publish(self, events: Sequence[Event], *, deliver: bool = True) -> list[bytes]:
        """Queue ``events`` (``deliver=False``: number them and lose them, a fault for tests)."""
        for event in events:
            if isinstance(event, AllBlocksCleared):
                self._add(trtllm.created_json(self._next_id, [self._num_blocks, 0]), deliver)
            elif isinstance(event, BlockStored):
                size = event.block_size
                blocks = [
                    (int(h), event.token_ids[n * size : (n + 1) * size]) for n, h in enumerate(event.block_hashes)
                ]
                parent = None if event.parent_block_hash is None else int(event.parent_block_hash)
                self._add(trtllm.stored_json(self._next_id, parent, blocks), deliver)
            elif isinstance(event, BlockRemoved):
                self._add(trtllm.removed_json(self._next_id, [int(h) for h in event.block_hashes]), deliver)
        return []

    def iteration_stats(self, engine: SimEngine) -> list[dict[str, Any]]:
        """trtllm-serve's ``GET /metrics``: the iterations since the last read (drained like the
        events), here one entry for the engine now when it ran any step since, else none."""
        stats, pool = engine.stats, engine.pool
        if stats.steps == self._steps_read:
            return []
        completed = stats.requests_finished - self._finished_read
        self._steps_read, self._finished_read = stats.steps, stats.requests_finished
        used = round(pool.usage * pool.num_blocks)
        return [
            {
                "iter": stats.steps,
                "numActiveRequests": len(engine.running),
                "numQueuedRequests": engine.num_waiting,
                "numCompletedRequests": completed,
                "inflightBatchingStats": {"numPausedRequests": 0},
                "kvCacheStats": {
                    "maxNumBlocks": pool.num_blocks,
                    "freeNumBlocks": pool.num_blocks - used,
                    "usedNumBlocks": used,
                    "tokensPerBlock": pool.block_size,
                },
            }
        ]

    def drain(self) -> list[dict[str, Any]]:
        """Every queued event, oldest first; the queue is empty afterwards."""
        events = list(self._queue)
        self._queue.clear()
        return events
