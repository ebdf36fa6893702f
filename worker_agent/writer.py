"""One worker's writes to the index, as the agent makes them.

The agent's mirror (inside :class:`~kvindex.redis_index.RedisIndex`) is the truth it knows; Redis
is a copy that can fall behind (unreachable), lose data (restart, failover, flush) or drift. Every
failure here is counted and logged, never raised into the event path: the mirror keeps the
changes and a re-assert writes them back as soon as Redis answers again.
"""

from __future__ import annotations

import logging
import time

from redis.exceptions import RedisError

from kvindex.errors import KVIndexError, StaleGenerationError
from kvindex.redis_index import RedisIndex
from kvindex.types import BlockChange, HeartbeatStatus, WorkerInfo, WorkerLoad
from worker_agent.metrics import AgentCounters

log = logging.getLogger(__name__)
REDIS_FAILURES = (RedisError, OSError, KVIndexError)


class WorkerWriter:
    def __init__(self, index: RedisIndex, counters: AgentCounters, ttl_ms: int) -> None:
        self.index = index
        self.info: WorkerInfo | None = None
        self.registered = False
        self.ttl_ms = ttl_ms
        self._counters = counters
        self._last_error_log = 0.0

    @property
    def model(self) -> str:
        assert self.info is not None
        return self.info.model

    @property
    def worker_id(self) -> str:
        assert self.info is not None
        return self.info.worker_id

    def _failed(self, what: str, exc: BaseException) -> None:
        self._counters.redis_errors += 1
        now = time.monotonic()
        if now - self._last_error_log > 5.0:  # one line per 5 s while Redis is down
            self._last_error_log = now
            log.warning("index %s failed (%s: %s); the mirror keeps the truth, re-assert will heal it",
                        what, type(exc).__name__, exc)  # fmt: skip

    async def register(self, info: WorkerInfo) -> bool:
        """Register with an empty block set; False (logged) when Redis refuses or is down."""
        try:
            await self.index.register(info, self.ttl_ms)
        except REDIS_FAILURES as exc:
            self._failed("register", exc)
            return False
        self.info, self.registered = info, True
        log.info("registered worker %s for model %s (block size %d)", info.worker_id, info.model, info.block_size)
        return True

    async def apply(self, changes: list[BlockChange]) -> None:
        try:
            await self.index.apply(self.model, self.worker_id, changes)
        except StaleGenerationError as exc:
            log.warning("the index lost this worker's data (%s); re-asserting", exc)
            await self.reassert("lost_data")
        except REDIS_FAILURES as exc:
            self._failed("write", exc)

    async def clear(self) -> None:
        try:
            await self.index.clear(self.model, self.worker_id)
        except StaleGenerationError:
            await self.reassert("lost_data")  # the mirror is empty now: this registers afresh
        except REDIS_FAILURES as exc:
            self._failed("clear", exc)

    async def reassert(self, reason: str) -> bool:
        self._counters.reasserts[reason] += 1
        started = time.monotonic()
        try:
            await self.index.reassert(self.model, self.worker_id)
        except REDIS_FAILURES as exc:
            self._failed(f"re-assert ({reason})", exc)
            return False
        blocks = self.index.mirror(self.model, self.worker_id).indexed_count
        log.info("re-asserted %d blocks (%s) in %.0f ms", blocks, reason, 1000 * (time.monotonic() - started))
        return True

    async def heartbeat(self) -> HeartbeatStatus | None:
        try:
            return await self.index.heartbeat(self.model, self.worker_id, self.ttl_ms)
        except REDIS_FAILURES as exc:
            self._failed("heartbeat", exc)
            return None

    async def report_load(self, load: WorkerLoad) -> None:
        try:
            await self.index.report_load(self.model, self.worker_id, load)
        except REDIS_FAILURES as exc:
            self._failed("load report", exc)

    def needs_reassert(self) -> bool:
        return self.index.needs_reassert(self.model, self.worker_id)

    async def drifted(self) -> bool:
        """True when Redis indexes a different number of blocks than the mirror."""
        try:
            blocks = await self.index.indexed_blocks(self.model, self.worker_id)
        except REDIS_FAILURES as exc:
            self._failed("verify", exc)
            return False
        expected = self.index.mirror(self.model, self.worker_id).indexed_count
        if blocks != expected:
            log.warning("index holds %s blocks for this worker, the mirror %d: re-asserting", blocks, expected)
            return True
        return False

    async def deregister(self) -> None:
        """Leave the index (graceful shutdown, or the engine went down)."""
        if not self.registered:
            return
        self.registered = False
        try:
            await self.index.deregister(self.model, self.worker_id)
            log.info("deregistered worker %s", self.worker_id)
        except REDIS_FAILURES as exc:
            self._failed("deregister", exc)  # it expires after its TTL anyway
