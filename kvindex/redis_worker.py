"""One worker's registration in the Redis index, held by the client that registered it.

:meth:`RedisIndex.register <kvindex.redis_index.RedisIndex.register>` returns a
:class:`RedisWorker`: the one owner of what this client knows about the worker - the
:class:`~kvindex.mirror.BlockMirror` of its blocks, its current gid and epoch, the op id of its
last write, the length of its block log, whether Redis may lack part of the mirror
(:meth:`RedisWorker.needs_reassert`) and the load it last reported. Every write of the worker
goes through it (the index's ``(model, worker_id)`` methods look the handle up and call it).

A handle stops working (:attr:`RedisWorker.active` is False, writes raise
:class:`~kvindex.errors.NotRegisteredError`) once the worker is deregistered or evicted, or
registered again through the same index (the new registration has its own handle).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence

from redis.exceptions import RedisError, ResponseError

from kvindex import calls as lua
from kvindex.bucket_writes import GenerationWrites
from kvindex.calls import BucketPages
from kvindex.cluster import RedisClient, is_cluster
from kvindex.errors import NotRegisteredError, StaleGenerationError
from kvindex.generations import register_worker, retire, stage_generation, swap_generation
from kvindex.keys import KeySchema
from kvindex.mirror import BlockMirror
from kvindex.page_writes import BucketPlan, PagePlacer, log_entries, plan_pages
from kvindex.pages import Where
from kvindex.replies import decode, raise_script_error
from kvindex.scripts import Scripts
from kvindex.types import (
    BlockChange,
    HeartbeatStatus,
    Registration,
    RemovedBlocks,
    StoredRun,
    WorkerInfo,
    WorkerLoad,
    WriteResult,
    adapter_names,
)

# Page changes per page_apply.lua call. On a single Redis a write's pages in every bucket go in
# one call, so readers see all of it or none of it: a vLLM step stores at most
# max_num_batched_tokens / block_size blocks and evicts about as many, a few hundred pages at
# most. Only a larger write (a re-assert) is cut into calls of this many pages.
MAX_PAGES_PER_CALL = 1024
# Rewrite a gid's page log in a bucket once it lists this many more entries than the gid holds there.
RELOG_SLACK = 256
# How long a bucket remembers that gc collected a gid there (apply.lua then refuses the gid).
DEAD_TTL_MS = 86_400_000


def capacity_limit(capacity_blocks: int) -> int:
    """Most blocks a worker indexes when its engine caches ``capacity_blocks``: the capacity plus
    a small slack (1/64 + 16). An engine never holds more distinct blocks than its cache has,
    and vLLM reports an eviction before the store that reuses the block, so the slack only
    absorbs what the agent cannot see exactly (the engine's reserved null block, a capacity
    reported a little off or changed by an engine restart); a mirror that runs away (lost
    removal events, a buggy engine) stops within 2% of the engine's real size."""
    return capacity_blocks + capacity_blocks // 64 + 16


# How long a gid staged for a re-assert waits for its swap before gc may collect it: far longer
# than any refill (a million blocks at ~100,000 per second take ~10 s).
STAGE_TTL_MS = 600_000


class RedisWorker:
    """A registered worker's writer state and writes (:class:`kvindex.interface.WorkerHandle`)."""

    def __init__(
        self,
        client: RedisClient,
        scripts: Scripts,
        schema: KeySchema,
        info: WorkerInfo,
        ttl_ms: int,
        registration: Registration,
        on_close: Callable[[RedisWorker], None] | None = None,
    ) -> None:
        self.info = info
        self.keys = schema.for_model(info.model)
        self.ttl_ms = ttl_ms
        self.gid, self.epoch = registration.gid, registration.epoch
        self.writes = GenerationWrites(self.gid)  # the gid's op ids, logs and entries per bucket
        self.mirror = BlockMirror()
        self.placer = PagePlacer()  # where the mirror's indexed blocks sit in pages
        self.dirty = False  # a write failed: Redis may lack part of the mirror until reassert()
        self.load: WorkerLoad | None = None
        self.split_batches = 0  # writes too large for one page_apply.lua call (split over several)
        self.stage_ttl_ms = STAGE_TTL_MS
        self._explicit_limit: int | None = None  # set_block_limit(); else the engine's capacity
        self.active = True
        self._lock = asyncio.Lock()  # one write at a time: a re-assert's snapshot stays whole
        self._client = client
        self._scripts = scripts
        self._schema = schema
        self._on_close = on_close

    def __repr__(self) -> str:
        state = "active" if self.active else "closed"
        return f"RedisWorker({self.info.worker_id!r}, model={self.info.model!r}, gid={self.gid}, {state})"

    @property
    def model(self) -> str:
        return self.info.model

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def registration(self) -> Registration:
        return Registration(self.gid, self.epoch)

    def close(self) -> None:
        """Stop using this handle (no Redis call): deregistered, evicted, or superseded."""
        if self.active:
            self.active = False
            if self._on_close is not None:
                self._on_close(self)

    def _check_open(self) -> None:
        if not self.active:
            raise NotRegisteredError(
                f"worker {self.worker_id!r} of model {self.model!r} was deregistered or registered again; "
                "this handle is closed"
            )

    def _new_generation(self, gid: int) -> None:
        self.gid = gid
        self.writes = GenerationWrites(gid)

    # --- writes -----------------------------------------------------------------------------

    async def store(self, runs: Sequence[StoredRun]) -> WriteResult:
        return await self.apply(runs)

    async def remove(self, blocks: Sequence[int]) -> WriteResult:
        return await self.apply([RemovedBlocks(tuple(blocks))])

    async def apply(self, changes: Sequence[BlockChange]) -> WriteResult:
        """Apply one engine batch of stores and removals, in order (see :meth:`apply_batches`)."""
        return await self.apply_batches([changes])

    async def apply_batches(self, batches: Sequence[Sequence[BlockChange]]) -> WriteResult:
        """Apply engine batches in order, as the page changes they make (kvindex.pages). On a
        single Redis they reach Redis in one page_apply.lua call, so readers see all of them or
        none; on a cluster, one call per bucket (a match reads each bucket's pages whole). Only
        a write of more than MAX_PAGES_PER_CALL pages is split (counted in
        :attr:`split_batches`).

        The mirror is updated first. If Redis cannot be reached, the handle is marked dirty:
        later calls only update the mirror, and :meth:`reassert` (which the agent retries until
        it succeeds) writes everything back. A StaleGenerationError (Redis lost data, or another
        registration took over) is raised and also calls for :meth:`reassert`."""
        self._check_open()
        async with self._lock:
            touched, result = self._follow(batches)
            if self.dirty:
                return result
            try:
                await self._send(plan_pages(self.placer, self.writes.sent, touched))
            except (RedisError, OSError) as exc:
                if not isinstance(exc, ResponseError):
                    self.dirty = True  # unknown whether Redis applied it
                raise
            return result

    def _follow(self, batches: Sequence[Sequence[BlockChange]]) -> tuple[dict[Where, int], WriteResult]:
        """The batches into the mirror, and its index operations into the page placer: the pages
        touched (with their change in indexed blocks) and what happened."""
        touched: dict[Where, int] = {}
        result = WriteResult()
        for batch in batches:
            ops, batch_result = self.mirror.apply(batch)
            result += batch_result
            for where, delta in self.placer.apply(ops).items():
                touched[where] = touched.get(where, 0) + delta
        return touched, result

    async def clear(self) -> None:
        """Drop all of the worker's blocks (it stays registered, under a fresh generation)."""
        self._check_open()
        async with self._lock:
            self.mirror.clear()
            self.placer.clear()
            if self.dirty:
                return
            try:
                status, gid = await retire(self._scripts, self.keys, self.worker_id, "keep", self.gid)
            except (RedisError, OSError) as exc:
                if not isinstance(exc, ResponseError):
                    self.dirty = True
                raise
            if decode(status) != "ok":  # type: ignore[arg-type]
                raise StaleGenerationError(f"worker {self.worker_id!r} is {decode(status)} in the index")  # type: ignore[arg-type]
            self._new_generation(int(gid))  # type: ignore[call-overload]

    def needs_reassert(self) -> bool:
        """True after a write failed: Redis may lack changes the mirror has."""
        return self.dirty

    async def reassert(self) -> Registration:
        """Write the whole mirror to Redis again under a fresh generation: used when Redis lost
        data (restart, failover, flush), a write failed, to heal drift, and periodically.

        While Redis still holds this registration, the mirror goes into a staged gid that no
        reader counts (stage.lua), and swap.lua then makes it current and retires the old gid in
        one step: readers see the old generation until that moment and the whole new one after
        it, never an empty worker. When the registration is gone (Redis lost its data) or another
        client took it over, the worker registers afresh and is refilled (its blocks come back
        call by call)."""
        self._check_open()
        async with self._lock:
            try:
                registration = await self._refill_staged()
                if registration is None:
                    registration = await self._register_and_refill()
                self.dirty = False
                if self.load is not None:
                    await self.report_load(self.load)
            except (RedisError, OSError, StaleGenerationError):
                self.dirty = True
                raise
            return registration

    async def _refill_staged(self) -> Registration | None:
        staged = await stage_generation(self._scripts, self.keys, self.worker_id, self.gid, self.stage_ttl_ms)
        if staged is None:
            return None
        writes = GenerationWrites(staged)
        await self._write(writes, plan_pages(self.placer, writes.sent, self.placer.sizes()))
        await self._tally(writes, self.mirror.indexed_count)  # the page count; the block count waits for the swap
        registration = await swap_generation(
            self._scripts, self.keys, self.worker_id, self.gid, staged, self.ttl_ms, self.mirror.indexed_count
        )
        if registration is not None:
            self.gid, self.epoch, self.writes = staged, registration.epoch, writes
        return registration

    async def _register_and_refill(self) -> Registration:
        registration = await register_worker(self._client, self._scripts, self._schema, self.info, self.ttl_ms)
        self.epoch = registration.epoch
        self._new_generation(registration.gid)
        await self._send(plan_pages(self.placer, self.writes.sent, self.placer.sizes()))
        return registration

    async def heartbeat(self, ttl_ms: int | None = None) -> HeartbeatStatus:
        """Keep the worker alive for ``ttl_ms`` (default: the TTL it registered with, or the last
        one given here) from now, on the Redis server's clock."""
        self._check_open()
        if ttl_ms is not None:
            self.ttl_ms = ttl_ms
        status = await self._scripts.run(lua.heartbeat(self.keys, self.worker_id, self.gid, self.ttl_ms))
        return HeartbeatStatus(status)

    # --- the block limit ----------------------------------------------------------------------

    @property
    def block_limit(self) -> int | None:
        """Most blocks this worker indexes (None: no limit known): :meth:`set_block_limit`, else
        :func:`capacity_limit` of the engine's cache size from the last :meth:`report_load`."""
        return self.mirror.limit

    @property
    def blocks_over_limit(self) -> int:
        """Stored blocks left out of the index because the limit was reached (cumulative)."""
        return self.mirror.over_limit

    def set_block_limit(self, limit: int | None) -> None:
        """Index at most ``limit`` blocks (None: go back to the engine's reported capacity)."""
        if limit is not None and limit < 0:
            raise ValueError(f"block limit must be >= 0, got {limit}")
        self._explicit_limit = limit
        capacity = self.load.capacity_blocks if self.load is not None else None
        self.mirror.limit = limit if limit is not None else capacity_limit(capacity) if capacity else None

    async def report_load(self, load: WorkerLoad) -> HeartbeatStatus:
        self._check_open()
        self.load = load
        if self._explicit_limit is None and load.capacity_blocks:
            self.mirror.limit = capacity_limit(load.capacity_blocks)
        # An engine that does not say its cache size (an older vLLM, another engine) shows it by
        # its evictions: the routers' cost needs it to know what a prompt will evict. Only a
        # reported size limits the mirror (an inferred one is a lower bound).
        capacity = load.capacity_blocks or self.mirror.inferred_capacity()
        call = lua.load(self.keys, self.worker_id, self.gid, load.running, load.waiting, load.kv_usage, capacity)
        return HeartbeatStatus(await self._scripts.run(call))

    async def set_adapters(self, adapters: Sequence[str]) -> HeartbeatStatus:
        """The LoRA adapters the engine serves now (also what a re-registration announces)."""
        self._check_open()
        names = adapter_names(adapters)
        status = HeartbeatStatus(await self._scripts.run(lua.adapters(self.keys, self.worker_id, self.gid, names)))
        self.info = dataclasses.replace(self.info, adapters=names)
        return status

    async def set_kv_groups(self, kv_groups: str) -> HeartbeatStatus:
        """The engine's KV-cache groups, recorded beside its adapters (adapters.lua)."""
        self._check_open()
        call = lua.adapters(self.keys, self.worker_id, self.gid, self.info.adapters, kv_groups)
        return HeartbeatStatus(await self._scripts.run(call))

    async def deregister(self) -> None:
        """Leave the index (the worker's entries stop counting at once); closes the handle."""
        self._check_open()
        async with self._lock:
            await retire(self._scripts, self.keys, self.worker_id, "leave", self.gid)
            self.close()

    async def indexed_blocks(self) -> int | None:
        """How many blocks Redis indexes for this generation, summed over its buckets; None when
        the record is gone or belongs to another generation, or a bucket does not end at the
        last write sent to it (it lost writes: a failover, a flush). Compared with the mirror
        to find drift."""
        self._check_open()
        async with self._lock:
            gid = await self._client.hget(self.keys.worker(self.worker_id), "gid")
            if gid is None or int(gid) != self.gid:
                return None
            writes = self.writes
            buckets = sorted(writes.ops)
            async with self._client.pipeline(transaction=False) as pipe:
                for bucket in buckets:
                    pipe.hmget(self.keys.bucket(bucket).state(writes.gid), ["op", "n"])
                states = await pipe.execute()
        total = 0
        for bucket, (op, entries) in zip(buckets, states, strict=True):
            if int(op or 0) != writes.ops[bucket]:
                return None
            total += int(entries or 0)
        return total

    # --- sending ----------------------------------------------------------------------------

    async def _send(self, plans: Sequence[BucketPlan]) -> None:
        writes = self.writes
        await self._write(writes, plans)
        # Also after a write with nothing to send: Redis says whether this gid is still current.
        status = await self._tally(writes, self.mirror.indexed_count)
        if status != "ok":
            raise StaleGenerationError(f"worker {self.worker_id!r} is {status} in the index: register again")
        for bucket in writes.buckets_to_relog(RELOG_SLACK, [plan.bucket for plan in plans]):
            await self._relog(bucket)

    async def _tally(self, writes: GenerationWrites, blocks: int) -> str:
        """The gid's block count and the pages its writes created, into the model's slot;
        tally.lua's status ('ok' while ``writes.gid`` is the worker's current gid)."""
        delta = writes.key_delta
        status = await self._scripts.run(lua.tally(self.keys, self.worker_id, writes.gid, blocks, delta))
        writes.key_delta -= delta
        return status

    async def _write(self, writes: GenerationWrites, plans: Sequence[BucketPlan]) -> None:
        """``plans`` for ``writes.gid``: its new buckets claimed first (claim.lua), then the page
        changes: on a single Redis in one call (pipelined calls of MAX_PAGES_PER_CALL pages for a
        larger write); on a cluster one call per bucket, all buckets at once."""
        new_buckets = writes.unclaimed(plans)
        if new_buckets:
            status = await self._scripts.run(lua.claim(self.keys, self.worker_id, writes.gid, new_buckets))
            if status != "ok":
                raise StaleGenerationError(f"worker {self.worker_id!r} is {status} in the index: register again")
            writes.claimed.update(new_buckets)
        parts = self._parts(writes, plans)
        if is_cluster(self._client):
            rounds: list[list[BucketPages]] = []
            seen: dict[int, int] = {}
            for part in parts:  # round k: each bucket's k-th part
                k = seen[part.bucket.number] = seen.get(part.bucket.number, -1) + 1
                if k == len(rounds):
                    rounds.append([])
                rounds[k].append(part)
            batches = [[[part] for part in round_parts] for round_parts in rounds]
        else:
            batches = [_calls_of(parts)]
        for calls in batches:
            replies = await self._scripts.call_many([lua.page_apply(writes.gid, call) for call in calls])
            for call, reply in zip(calls, replies, strict=True):
                self._check_applied(writes, call, reply)

    def _parts(self, writes: GenerationWrites, plans: Sequence[BucketPlan]) -> list[BucketPages]:
        """Each bucket's changes with their op ids, cut into parts of MAX_PAGES_PER_CALL pages."""
        parts: list[BucketPages] = []
        for plan in plans:
            previous = writes.ops.get(plan.bucket, 0)
            chunks = [plan.changes[i : i + MAX_PAGES_PER_CALL] for i in range(0, len(plan.changes), MAX_PAGES_PER_CALL)]
            if len(chunks) > 1:
                self.split_batches += 1
            for i, chunk in enumerate(chunks or [[]]):
                delta = plan.block_delta if i == 0 else 0
                parts.append(BucketPages(self.keys.bucket(plan.bucket), previous, previous + 1, delta, chunk))
                previous += 1
        return parts

    def _check_applied(self, writes: GenerationWrites, call: Sequence[BucketPages], reply: object) -> None:
        if isinstance(reply, ResponseError):
            raise_script_error(reply)
        if isinstance(reply, Exception):
            raise reply
        for part, fields in zip(call, reply, strict=True):  # type: ignore[call-overload]
            status = decode(fields[0])
            missing, log_entries, page_delta, entries = (int(fields[i]) for i in (3, 4, 5, 6))
            if status in ("lost", "dead") or missing:
                why = {"lost": "lost writes", "dead": "was collected"}.get(status, f"lacks {missing} holdings")
                raise StaleGenerationError(
                    f"bucket {part.bucket.number} of worker {self.worker_id!r} {why} in Redis: the index lost data; "
                    "re-assert the worker"
                )
            writes.applied(part.bucket.number, part.op, log_entries, entries, page_delta)

    async def _relog(self, bucket_number: int) -> None:
        writes = self.writes
        bucket = self.keys.bucket(bucket_number)
        log = log_entries(writes.sent.pages_in(bucket_number))
        previous, op = writes.next_op(bucket_number)
        call = lua.relog(bucket, writes.gid, previous, op, log.encode(), page_log=True)
        status, entries = await self._scripts.run(call)
        if status in ("lost", "dead"):
            raise StaleGenerationError(f"bucket {bucket_number} of worker {self.worker_id!r} lost writes in Redis")
        writes.ops[bucket_number] = op
        writes.logs[bucket_number] = int(entries)


def _calls_of(parts: Sequence[BucketPages]) -> list[list[BucketPages]]:
    """Parts in calls of at most MAX_PAGES_PER_CALL page changes each, in order."""
    calls: list[list[BucketPages]] = [[]]
    size = 0
    for part in parts:
        if calls[-1] and size + len(part.changes) > MAX_PAGES_PER_CALL:
            calls.append([])
            size = 0
        calls[-1].append(part)
        size += len(part.changes)
    return [call for call in calls if call]
