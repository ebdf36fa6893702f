"""The reference index: a naive in-memory implementation whose answers define correct.

It stores each worker's blocks as a plain multiset and answers ``match`` by walking the chain
block by block. No prefix-closure tricks, no generations: if the Redis index ever disagrees
with this one on the same operations, the Redis index is wrong.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvindex.errors import BlockSizeMismatchError, KVIndexError, NotRegisteredError
from kvindex.interface import DEFAULT_GC_BUDGET, DEFAULT_GC_GRACE_MS, DEFAULT_TTL_MS
from kvindex.pages import PAGE_BLOCKS
from kvindex.types import (
    BlockChange,
    GcResult,
    HeartbeatStatus,
    ModelStats,
    Registration,
    RemovedBlocks,
    StoredRun,
    WorkerInfo,
    WorkerLoad,
    WorkerRecord,
    WriteResult,
    adapter_names,
)


@dataclass
class _Worker:
    info: WorkerInfo
    gid: int
    epoch: int
    ttl_ms: int
    heartbeat_ms: int
    copies: dict[int, int] = field(default_factory=dict)
    parent: dict[int, int | None] = field(default_factory=dict)
    load: WorkerLoad | None = None
    load_ms: int = 0
    closed: bool = False  # deregistered, or registered again: its handle no longer writes
    adapters: tuple[str, ...] = ()
    kv_groups: str = ""

    def deadline_ms(self) -> int:
        return self.heartbeat_ms + self.ttl_ms

    def page_first(self, block: int) -> int:
        """The first block of the page (PAGE_BLOCKS blocks at fixed depths) that holds ``block``."""
        path = [block]
        while (parent := self.parent[path[-1]]) is not None:
            path.append(parent)
        return path[-1 - (len(path) - 1) // PAGE_BLOCKS * PAGE_BLOCKS]

    def reachable(self, block: int | None) -> bool:
        """True when ``block`` and all its ancestors are held."""
        while block is not None:
            if block not in self.copies:
                return False
            block = self.parent[block]
        return True


@dataclass
class _Model:
    block_size: int | None = None
    gid_seq: int = 0
    workers: dict[str, _Worker] = field(default_factory=dict)


def _wall_clock_ms() -> int:
    return int(time.time() * 1000)


class ReferenceIndex:
    """In-memory :class:`kvindex.interface.KVIndex`."""

    def __init__(self, clock_ms: Callable[[], int] = _wall_clock_ms) -> None:
        self._clock_ms = clock_ms
        self._models: dict[str, _Model] = {}
        self._latest: dict[tuple[str, str], _Worker] = {}  # each worker's last registration here

    def _alive(self, worker: _Worker) -> bool:
        return worker.deadline_ms() > self._clock_ms()

    def _writer(self, model: str, worker_id: str) -> _Worker:
        worker = self._models.get(model, _Model()).workers.get(worker_id)
        if worker is None:
            raise NotRegisteredError(f"worker {worker_id!r} of model {model!r} is not registered")
        return worker

    async def register(self, worker: WorkerInfo, ttl_ms: int = DEFAULT_TTL_MS) -> ReferenceWorker:
        _check_ttl(ttl_ms)
        state = self._models.setdefault(worker.model, _Model())
        if state.block_size is not None and state.block_size != worker.block_size:
            others = [w for wid, w in state.workers.items() if wid != worker.worker_id and self._alive(w)]
            if others:
                raise BlockSizeMismatchError(
                    f"block size mismatch: model {worker.model} is served with block_size "
                    f"{state.block_size} by alive worker {others[0].info.worker_id}, "
                    f"worker {worker.worker_id} announced {worker.block_size}"
                )
        state.block_size = worker.block_size
        state.gid_seq += 1
        # The epoch counts registrations of this id while its record exists (as in Redis, where
        # deregistering or garbage collection deletes the record).
        previous = state.workers.get(worker.worker_id)
        epoch = previous.epoch + 1 if previous else 1
        replaced = self._latest.get((worker.model, worker.worker_id))
        if replaced is not None:
            replaced.closed = True  # even when gc forgot it: as the Redis client forgets only its handle
        registered = _Worker(worker, state.gid_seq, epoch, ttl_ms, self._clock_ms())
        registered.adapters = adapter_names(worker.adapters)
        state.workers[worker.worker_id] = self._latest[(worker.model, worker.worker_id)] = registered
        return ReferenceWorker(self, registered)

    def handle(self, model: str, worker_id: str) -> ReferenceWorker:
        worker = self._latest.get((model, worker_id))
        if worker is None or worker.closed:
            raise NotRegisteredError(f"worker {worker_id!r} of model {model!r} was not registered through this index")
        return ReferenceWorker(self, worker)

    # The writes by (model, worker id): what a ReferenceWorker does for its registration.

    def holds(self, worker: _Worker) -> bool:
        """True while ``worker`` is its id's current registration (not forgotten by gc)."""
        return self._models.get(worker.info.model, _Model()).workers.get(worker.info.worker_id) is worker

    async def _heartbeat(self, model: str, worker_id: str, ttl_ms: int = DEFAULT_TTL_MS) -> HeartbeatStatus:
        _check_ttl(ttl_ms)
        worker = self._models.get(model, _Model()).workers.get(worker_id)
        if worker is None:
            return HeartbeatStatus.MISSING
        worker.heartbeat_ms = self._clock_ms()
        worker.ttl_ms = ttl_ms
        return HeartbeatStatus.OK

    async def _store(self, model: str, worker_id: str, runs: Sequence[StoredRun]) -> WriteResult:
        worker = self._writer(model, worker_id)
        applied = skipped = 0
        for run in runs:
            parent = run.parent
            for block in run.hashes:
                if block in worker.copies:
                    worker.copies[block] += 1
                else:
                    worker.copies[block] = 1
                    worker.parent[block] = parent
                if worker.reachable(block):
                    applied += 1
                else:
                    skipped += 1
                parent = block
        return WriteResult(applied=applied, skipped=skipped)

    async def _remove(self, model: str, worker_id: str, blocks: Sequence[int]) -> WriteResult:
        worker = self._writer(model, worker_id)
        applied = missing = 0
        for block in blocks:
            copies = worker.copies.get(block)
            if copies is None:
                missing += 1
                continue
            applied += 1
            if copies > 1:
                worker.copies[block] = copies - 1
            else:
                del worker.copies[block]
                del worker.parent[block]
        return WriteResult(applied=applied, missing=missing)

    async def _apply(self, model: str, worker_id: str, changes: Sequence[BlockChange]) -> WriteResult:
        result = WriteResult()
        for change in changes:
            if isinstance(change, RemovedBlocks):
                result += await self._remove(model, worker_id, change.hashes)
            else:
                result += await self._store(model, worker_id, [change])
        return result

    async def _report_load(self, model: str, worker_id: str, load: WorkerLoad) -> HeartbeatStatus:
        worker = self._writer(model, worker_id)
        worker.load, worker.load_ms = load, self._clock_ms()
        return HeartbeatStatus.OK

    async def _clear(self, model: str, worker_id: str) -> None:
        worker = self._writer(model, worker_id)
        state = self._models[model]
        state.gid_seq += 1
        worker.gid = state.gid_seq
        worker.copies.clear()
        worker.parent.clear()

    async def _deregister(self, model: str, worker_id: str) -> None:
        self._writer(model, worker_id).closed = True
        del self._models[model].workers[worker_id]

    async def group_holders(self, model: str, names: Sequence[int]) -> list[set[str]]:
        return [{w for w, depth in (await self.match(model, [name])).items() if depth} for name in names]

    async def match(self, model: str, chain: Sequence[int]) -> dict[str, int]:
        out = {}
        for worker_id, worker in self._models.get(model, _Model()).workers.items():
            if not self._alive(worker):
                continue
            matched = 0
            for block in chain:
                if block not in worker.copies:
                    break
                matched += 1
            out[worker_id] = matched
        return out

    async def owners(self, model: str, block: int, chain: Sequence[int] | None = None) -> dict[str, int]:
        """Workers that hold ``block`` (and its ancestors), each with 1: copies are the writer's.
        (``chain``, the block's chain, is what a paged backend needs to find it.)"""
        return {
            worker_id: 1
            for worker_id, worker in self._models.get(model, _Model()).workers.items()
            if self._alive(worker) and block in worker.copies and worker.reachable(block)
        }

    async def workers(self, model: str) -> list[WorkerRecord]:
        now = self._clock_ms()
        return [
            WorkerRecord(
                worker_id=w.info.worker_id,
                model=model,
                url=w.info.url,
                block_size=w.info.block_size,
                dp_rank=w.info.dp_rank,
                gid=w.gid,
                epoch=w.epoch,
                alive=self._alive(w),
                blocks=sum(1 for b in w.copies if w.reachable(b)),
                heartbeat_age_ms=now - w.heartbeat_ms,
                ttl_ms=w.ttl_ms,
                load=w.load,
                load_age_ms=now - w.load_ms if w.load else None,
                adapters=w.adapters,
                kv_groups=w.kv_groups,
                tier=w.info.tier,
                tier_of=w.info.tier_of,
                role=w.info.role,
                max_model_len=w.info.max_model_len or None,
                engine_kind=w.info.engine_kind or None,
            )
            for w in sorted(self._models.get(model, _Model()).workers.values(), key=lambda w: w.info.worker_id)
        ]

    async def block_size(self, model: str) -> int | None:
        return self._models.get(model, _Model()).block_size

    async def models(self) -> list[str]:
        return sorted(self._models)

    async def stats(self, model: str) -> ModelStats:
        records = await self.workers(model)
        pages: set[int] = set()  # the first block of every page with a holder (kvindex.pages)
        for worker in self._models.get(model, _Model()).workers.values():
            pages.update(worker.page_first(b) for b in worker.copies if worker.reachable(b))
        return ModelStats(
            model=model,
            block_size=await self.block_size(model),
            workers=len(records),
            alive_workers=sum(r.alive for r in records),
            entries=sum(r.blocks for r in records),
            block_keys=0,  # the layout before pages only
            gids_pending_gc=0,
            pages=len(pages),
        )

    async def gc(self, model: str, budget: int = DEFAULT_GC_BUDGET, grace_ms: int = DEFAULT_GC_GRACE_MS) -> GcResult:
        state = self._models.get(model, _Model())
        cutoff = self._clock_ms() - grace_ms
        # gc (gc_retire.lua) retires at most min(budget, 1000) dead workers per call, the longest dead first.
        expired = sorted((w.deadline_ms(), wid) for wid, w in state.workers.items() if w.deadline_ms() <= cutoff)
        dead = [wid for _, wid in expired[: min(budget, 1000)]]
        removed = 0
        for worker_id in dead:
            removed += len(state.workers.pop(worker_id).copies)
        return GcResult(workers_retired=len(dead), entries_removed=removed, gids_finished=len(dead), gids_pending=0)


MAX_TTL_MS = 86_400_000  # register.lua's and heartbeat.lua's bound


def _check_ttl(ttl_ms: float) -> None:
    if not (0 <= ttl_ms <= MAX_TTL_MS and float(ttl_ms).is_integer()):  # NaN fails the comparison
        raise KVIndexError(f"ttl_ms must be an integer from 0 to 86400000 (one day), got {ttl_ms}")


class ReferenceWorker:
    """The reference's :class:`kvindex.interface.WorkerHandle`: the index's writes for one
    registration, refused once that registration was deregistered or replaced. (A worker that gc
    forgot is still active here, as in Redis: its heartbeat answers MISSING.)"""

    def __init__(self, index: ReferenceIndex, worker: _Worker) -> None:
        self._index = index
        self._worker = worker

    @property
    def info(self) -> WorkerInfo:
        return self._worker.info

    @property
    def registration(self) -> Registration:
        return Registration(self._worker.gid, self._worker.epoch)

    @property
    def active(self) -> bool:
        return not self._worker.closed

    def _ids(self) -> tuple[str, str]:
        if self._worker.closed:
            raise NotRegisteredError(f"worker {self.info.worker_id!r} was deregistered or registered again")
        if not self._index.holds(self._worker):
            raise NotRegisteredError(f"worker {self.info.worker_id!r} is not registered (gc forgot it)")
        return self.info.model, self.info.worker_id

    async def store(self, runs: Sequence[StoredRun]) -> WriteResult:
        return await self._index._store(*self._ids(), runs)

    async def remove(self, blocks: Sequence[int]) -> WriteResult:
        return await self._index._remove(*self._ids(), blocks)

    async def apply(self, changes: Sequence[BlockChange]) -> WriteResult:
        return await self._index._apply(*self._ids(), changes)

    async def clear(self) -> None:
        await self._index._clear(*self._ids())

    async def heartbeat(self, ttl_ms: int | None = None) -> HeartbeatStatus:
        if not self._worker.closed and not self._index.holds(self._worker):
            return HeartbeatStatus.MISSING
        return await self._index._heartbeat(*self._ids(), self._worker.ttl_ms if ttl_ms is None else ttl_ms)

    async def report_load(self, load: WorkerLoad) -> HeartbeatStatus:
        return await self._index._report_load(*self._ids(), load)

    async def set_adapters(self, adapters: Sequence[str]) -> HeartbeatStatus:
        if not self._worker.closed and not self._index.holds(self._worker):
            return HeartbeatStatus.MISSING
        names = adapter_names(adapters)
        self._ids()
        self._worker.adapters = names
        return HeartbeatStatus.OK

    async def set_kv_groups(self, kv_groups: str) -> HeartbeatStatus:
        if not self._worker.closed and not self._index.holds(self._worker):
            return HeartbeatStatus.MISSING
        self._ids()
        self._worker.kv_groups = kv_groups
        return HeartbeatStatus.OK

    async def deregister(self) -> None:
        if not self._worker.closed and not self._index.holds(self._worker):
            self._worker.closed = True  # gc forgot it already: nothing left to remove (as in Redis)
            return
        await self._index._deregister(*self._ids())
