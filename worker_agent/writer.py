"""One worker's writes to the index, as the agent makes them.

The worker's handle (:class:`~kvindex.redis_worker.RedisWorker`, from ``RedisIndex.register``)
owns its registration: the mirror of its blocks (the truth the agent knows), gid and op ids.
Redis is a copy that can fall behind (unreachable), lose data (restart, failover, flush) or
drift. Every failure here is counted and logged, never raised into the event path: the mirror
keeps the changes and a re-assert writes them back as soon as Redis answers again.

An engine that reports lower cache tiers (CPU, disk, remote: kvindex/tiers.py) gets a tier holder
per tier, registered here the first time that tier has blocks, and written, heartbeaten,
re-asserted, cleared and deregistered with the worker. A batch's lower tiers are written before
its GPU changes: a block that moves from the GPU to the CPU is stored there before it leaves the
GPU, so a router never sees it absent in between (the reverse move in one batch could show such a
gap for the length of one write: vLLM loads a block back only when it is used, not while the
lower tier evicts it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping, Sequence

from kvindex.errors import REDIS_FAILURES, StaleGenerationError
from kvindex.mirror import BlockMirror
from kvindex.redis_index import RedisIndex
from kvindex.redis_worker import RedisWorker
from kvindex.tiers import GPU, LOWER_TIERS, tier_holder
from kvindex.types import BlockChange, HeartbeatStatus, WorkerInfo, WorkerLoad
from worker_agent.metrics import AgentCounters

log = logging.getLogger(__name__)


class WorkerWriter:
    """The agent's side of its worker's handle: registration, writes, and what failed. Writes
    while not registered are dropped (there is nothing to write to)."""

    def __init__(self, index: RedisIndex, counters: AgentCounters, ttl_ms: int) -> None:
        self.index = index
        self.handle: RedisWorker | None = None  # the worker's own registration: its GPU blocks
        self._tiers: dict[str, RedisWorker] = {}  # its tier holders', by tier
        self.ttl_ms = ttl_ms
        self._counters = counters
        self._last_error_log = 0.0
        self._limits_of: RedisWorker | None = None
        self._limits_seen = (0, 0)
        self._recorded_groups = ""  # the KV-cache groups the record holds (kvindex.groups)

    @property
    def registered(self) -> bool:
        return self.handle is not None and self.handle.active

    @property
    def info(self) -> WorkerInfo | None:
        return self.handle.info if self.handle is not None else None

    @property
    def model(self) -> str:
        assert self.handle is not None
        return self.handle.model

    @property
    def worker_id(self) -> str:
        assert self.handle is not None
        return self.handle.worker_id

    @property
    def mirror(self) -> BlockMirror | None:
        """The worker's blocks as the agent knows them (None while not registered)."""
        handle = self._live()
        return handle.mirror if handle is not None else None

    def _failed(self, what: str, exc: BaseException) -> None:
        self._counters.redis_errors += 1
        now = time.monotonic()
        if now - self._last_error_log > 5.0:  # one line per 5 s while Redis is down
            self._last_error_log = now
            log.warning(
                "index %s failed (%s: %s); the mirror keeps the truth, re-assert will heal it",
                what,
                type(exc).__name__,
                exc,
            )

    def _live(self) -> RedisWorker | None:
        return self.handle if self.handle is not None and self.handle.active else None

    def _all(self) -> list[RedisWorker]:
        """The worker's live handles: its own, then its tier holders'."""
        live = self._live()
        return [] if live is None else [live, *(h for h in self._tiers.values() if h.active)]

    async def register(self, info: WorkerInfo) -> bool:
        """Register with an empty block set; False (logged) when Redis refuses or is down. The
        tier holders of a registration before it are deregistered (they start empty again)."""
        await self._drop_tiers()
        try:
            self.handle = await self.index.register(info, self.ttl_ms)
        except REDIS_FAILURES as exc:
            self._failed("register", exc)
            return False
        fields = {"worker_id": info.worker_id, "model": info.model, "block_size": info.block_size}
        log.info("registered worker", extra={"fields": fields})
        self._recorded_groups = ""  # a new record: the groups are said again at the next flush
        return True

    async def note_kv_groups(self, kv_groups: str) -> None:
        """The engine's KV-cache groups (kvindex.groups.format_groups) as its events name them:
        recorded when they change or the worker registered again (logged when Redis did not
        take them: the next flush tries again)."""
        handle = self._live()
        if handle is None or kv_groups == self._recorded_groups:
            return
        try:
            await handle.set_kv_groups(kv_groups)
        except REDIS_FAILURES as exc:
            self._failed("KV-cache groups", exc)
            return
        self._recorded_groups = kv_groups

    async def apply(self, changes: list[BlockChange]) -> None:
        await self.apply_batches([changes])

    async def apply_batches(self, batches: list[list[BlockChange]]) -> None:
        """The GPU's changes of engine batches in order; each reaches Redis in one atomic call (if it fits one)."""
        await self.apply_tiers({GPU: batches})

    async def apply_tiers(self, tiers: Mapping[str, Sequence[list[BlockChange]]]) -> None:
        """Each tier's changes of engine batches in order, the lower tiers first (the module's docstring)."""
        if self._live() is None:
            return
        for tier in (*LOWER_TIERS, GPU):
            batches = tiers.get(tier)
            if not batches:
                continue
            handle = await self._tier(tier)
            if handle is None:
                continue
            try:
                await handle.apply_batches(batches)
                if tier == GPU:
                    self._count_limits(handle)
            except StaleGenerationError as exc:
                log.warning("the index lost this worker's data (%s); re-asserting", exc)
                await self.reassert("lost_data")
                return
            except REDIS_FAILURES as exc:
                self._failed("write", exc)

    async def _tier(self, tier: str) -> RedisWorker | None:
        """The handle that holds ``tier``'s blocks, registered now if it is the tier's first."""
        handle = self._live()
        if tier == GPU or handle is None:
            return handle
        holder = self._tiers.get(tier)
        if holder is not None and holder.active:
            return holder
        gpu = handle.info
        info = WorkerInfo(
            tier_holder(gpu.worker_id, tier),
            gpu.model,
            gpu.url,
            gpu.block_size,
            gpu.dp_rank,
            tier=tier,
            tier_of=gpu.worker_id,
            role=gpu.role,
            engine_kind=gpu.engine_kind,
        )
        try:
            holder = self._tiers[tier] = await self.index.register(info, self.ttl_ms)
        except REDIS_FAILURES as exc:
            self._failed(f"register the {tier} tier", exc)
            return None
        log.info("registered the %s tier of worker %s", tier, gpu.worker_id)
        return holder

    async def _drop_tiers(self) -> None:
        """Deregister the tier holders (best effort: they expire after their TTL anyway)."""
        holders, self._tiers = list(self._tiers.values()), {}
        for holder in holders:
            if holder.active:
                with contextlib.suppress(*REDIS_FAILURES):
                    await holder.deregister()
            holder.close()

    def _count_limits(self, handle: RedisWorker) -> None:
        """Add what the handle refused or split since last seen to the agent's counters (a new
        handle, after a registration, counts from 0)."""
        if handle is not self._limits_of:
            self._limits_of, self._limits_seen = handle, (0, 0)
        over, split = handle.blocks_over_limit, handle.split_batches
        self._counters.blocks_over_limit += over - self._limits_seen[0]
        self._counters.split_batches += split - self._limits_seen[1]
        self._limits_seen = (over, split)

    async def clear(self) -> None:
        for handle in self._all():
            try:
                await handle.clear()
            except StaleGenerationError:
                await self.reassert("lost_data")  # the mirror is empty now: this registers afresh
                return
            except REDIS_FAILURES as exc:
                self._failed("clear", exc)

    async def reassert(self, reason: str) -> bool:
        handles = self._all()
        if not handles:
            return False
        self._counters.reasserts[reason] += 1
        started = time.monotonic()
        try:
            for handle in handles:
                await handle.reassert()
        except REDIS_FAILURES as exc:
            self._failed(f"re-assert ({reason})", exc)
            return False
        blocks = sum(handle.mirror.indexed_count for handle in handles)
        log.info("re-asserted %d blocks (%s) in %.0f ms", blocks, reason, 1000 * (time.monotonic() - started))
        return True

    async def heartbeat(self) -> HeartbeatStatus | None:
        """Every handle's heartbeat at once; the worst answer (superseded, then missing, then OK)."""
        handles = self._all()
        if not handles:
            return None
        try:
            statuses = await asyncio.gather(*(handle.heartbeat(self.ttl_ms) for handle in handles))
        except REDIS_FAILURES as exc:
            self._failed("heartbeat", exc)
            return None
        if statuses[0] is HeartbeatStatus.SUPERSEDED:
            return HeartbeatStatus.SUPERSEDED  # another agent registered the worker
        # a tier holder lost (or taken over without its worker): re-asserting rewrites them all
        return HeartbeatStatus.OK if all(s is HeartbeatStatus.OK for s in statuses) else HeartbeatStatus.MISSING

    async def report_load(self, load: WorkerLoad) -> None:
        handle = self._live()
        if handle is None:
            return
        try:
            await handle.report_load(load)
        except REDIS_FAILURES as exc:
            self._failed("load report", exc)

    async def set_adapters(self, adapters: tuple[str, ...]) -> bool:
        """The LoRA adapters the engine serves; False (logged) when Redis did not take them."""
        handle = self._live()
        if handle is None:
            return False
        try:
            await handle.set_adapters(adapters)
        except REDIS_FAILURES as exc:
            self._failed("adapters", exc)
            return False
        return True

    def needs_reassert(self) -> bool:
        return any(handle.needs_reassert() for handle in self._all())

    async def drifted(self) -> bool:
        """True when Redis indexes a different number of blocks than the mirror, in any tier."""
        handles = self._all()
        if not handles:
            return False
        self._counters.verifications += 1
        for handle in handles:
            try:
                blocks = await handle.indexed_blocks()
            except REDIS_FAILURES as exc:
                self._failed("verify", exc)
                return False
            expected = handle.mirror.indexed_count
            if blocks != expected:
                holder = handle.worker_id
                log.warning("index holds %s blocks for %s, the mirror %d: re-asserting", blocks, holder, expected)
                return True
        return False

    async def deregister(self) -> None:
        """Leave the index (graceful shutdown, or the engine went down)."""
        await self._drop_tiers()
        handle, self.handle = self._live(), None
        if handle is None:
            return
        try:
            await handle.deregister()
            log.info("deregistered worker %s", handle.worker_id)
        except REDIS_FAILURES as exc:
            self._failed("deregister", exc)  # it expires after its TTL anyway
        finally:
            handle.close()

    def superseded(self) -> None:
        """Another agent registered this worker: stop writing it, without deregistering (the
        registration in Redis is the other agent's now)."""
        handle, self.handle = self._live(), None
        if handle is not None:
            handle.close()
        for holder in self._tiers.values():
            holder.close()
        self._tiers = {}
