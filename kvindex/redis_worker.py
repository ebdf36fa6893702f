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
from collections.abc import Callable, Sequence

from redis.asyncio import Redis
from redis.exceptions import RedisError, ResponseError

from kvindex.codec import encode_ops, pack_hashes
from kvindex.errors import NotRegisteredError, StaleGenerationError
from kvindex.generations import register_worker, retire, stage_generation, swap_generation
from kvindex.keys import KeySchema
from kvindex.mirror import BlockMirror, IndexOp
from kvindex.replies import decode
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
)

# Index operations per apply.lua call. One engine batch is one call, so readers see all of it or
# none of it: a vLLM step stores at most max_num_batched_tokens / block_size blocks and evicts
# about as many, so this fits a whole step of up to 128k tokens at 16-token blocks. A call of
# this size keeps Redis busy ~25 ms (~1.5 us per operation); only a larger batch is split.
MAX_ITEMS_PER_CALL = 16384
# Rewrite a gid's block log once it lists this many more entries than the gid holds.
RELOG_SLACK = 1024


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
        client: Redis,
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
        self.op = 0  # the id of the last write sent under this gid
        self.mirror = BlockMirror()
        self.log_entries = 0
        self.dirty = False  # a write failed: Redis may lack part of the mirror until reassert()
        self.load: WorkerLoad | None = None
        self.split_batches = 0  # engine batches too large for one apply.lua call (split over several)
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

    def _next_op(self) -> int:
        self.op += 1
        return self.op

    # --- writes -----------------------------------------------------------------------------

    async def store(self, runs: Sequence[StoredRun]) -> WriteResult:
        return await self.apply(runs)

    async def remove(self, blocks: Sequence[int]) -> WriteResult:
        return await self.apply([RemovedBlocks(tuple(blocks))])

    async def apply(self, changes: Sequence[BlockChange]) -> WriteResult:
        """Apply one engine batch of stores and removals, in order, as one apply.lua call:
        readers see all of it or none of it (see :meth:`apply_batches`)."""
        return await self.apply_batches([changes])

    async def apply_batches(self, batches: Sequence[Sequence[BlockChange]]) -> WriteResult:
        """Apply engine batches in order. Each batch reaches Redis whole in one apply.lua call;
        consecutive batches share a call up to MAX_ITEMS_PER_CALL index operations. Only a
        single batch larger than that is split over several calls (counted in
        :attr:`split_batches`): readers may then see part of it.

        The mirror is updated first. If Redis cannot be reached, the handle is marked dirty:
        later calls only update the mirror, and :meth:`reassert` (which the agent retries until
        it succeeds) writes everything back. A StaleGenerationError (Redis lost data, or another
        registration took over) is raised and also calls for :meth:`reassert`."""
        self._check_open()
        async with self._lock:
            calls, result = self._plan_calls(batches)
            if self.dirty:
                return result
            try:
                await self._send_calls(calls)
            except (RedisError, OSError) as exc:
                if not isinstance(exc, ResponseError):
                    self.dirty = True  # unknown whether Redis applied it
                raise
            return result

    def _plan_calls(self, batches: Sequence[Sequence[BlockChange]]) -> tuple[list[list[IndexOp]], WriteResult]:
        """The batches' index operations (the mirror updated), grouped into apply.lua calls."""
        calls: list[list[IndexOp]] = []
        current: list[IndexOp] = []
        result = WriteResult()
        for batch in batches:
            ops, batch_result = self.mirror.apply(batch)
            result += batch_result
            if current and len(current) + len(ops) > MAX_ITEMS_PER_CALL:
                calls.append(current)
                current = []
            if len(ops) > MAX_ITEMS_PER_CALL:
                self.split_batches += 1
                pieces = [ops[i : i + MAX_ITEMS_PER_CALL] for i in range(0, len(ops), MAX_ITEMS_PER_CALL)]
                calls.extend(pieces[:-1])
                current = list(pieces[-1])
            else:
                current.extend(ops)
        if current or not calls:
            calls.append(current)  # even an empty call: Redis checks that this gid is current
        return calls, result

    async def clear(self) -> None:
        """Drop all of the worker's blocks (it stays registered, under a fresh generation)."""
        self._check_open()
        async with self._lock:
            self.mirror.clear()
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
            self.gid, self.op, self.log_entries = int(gid), 0, 0  # type: ignore[call-overload]

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
        ops = self.mirror.indexed_in_order()
        op = log_entries = 0
        for start in range(0, len(ops), MAX_ITEMS_PER_CALL):
            op += 1
            log_entries = await self._apply_call(staged, op, ops[start : start + MAX_ITEMS_PER_CALL])
        registration = await swap_generation(self._scripts, self.keys, self.worker_id, self.gid, staged, self.ttl_ms)
        if registration is not None:
            self.gid, self.epoch, self.op, self.log_entries = staged, registration.epoch, op, log_entries
        return registration

    async def _register_and_refill(self) -> Registration:
        registration = await register_worker(self._client, self._scripts, self._schema, self.info, self.ttl_ms)
        self.gid, self.epoch = registration.gid, registration.epoch
        self.op, self.log_entries = 0, 0
        await self._send(self.mirror.indexed_in_order())
        return registration

    async def heartbeat(self, ttl_ms: int | None = None) -> HeartbeatStatus:
        """Keep the worker alive for ``ttl_ms`` (default: the TTL it registered with, or the last
        one given here) from now, on the Redis server's clock."""
        self._check_open()
        if ttl_ms is not None:
            self.ttl_ms = ttl_ms
        keys = [self.keys.worker(self.worker_id), self.keys.alive]
        status = await self._scripts.run("heartbeat", keys, [self.gid, self.ttl_ms])
        return HeartbeatStatus(decode(status))

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
        args: list[str | int] = [self.gid, load.running, load.waiting, repr(load.kv_usage)]
        if load.capacity_blocks:
            args.append(load.capacity_blocks)
        status = await self._scripts.run("load", [self.keys.worker(self.worker_id)], args)
        return HeartbeatStatus(decode(status))

    async def deregister(self) -> None:
        """Leave the index (the worker's entries stop counting at once); closes the handle."""
        self._check_open()
        async with self._lock:
            await retire(self._scripts, self.keys, self.worker_id, "leave", self.gid)
            self.close()

    async def indexed_blocks(self) -> int | None:
        """How many blocks Redis indexes for this generation (None when the record is gone or
        belongs to another generation): compared with the mirror to find drift."""
        self._check_open()
        gid, blocks = await self._client.hmget(self.keys.worker(self.worker_id), ["gid", "blocks"])
        if gid is None or int(gid) != self.gid:
            return None
        return int(blocks or 0)

    # --- sending ----------------------------------------------------------------------------

    async def _send(self, ops: Sequence[IndexOp]) -> None:
        """``ops`` in as few apply.lua calls as MAX_ITEMS_PER_CALL allows (a re-assert's refill)."""
        await self._send_calls(
            [list(ops[i : i + MAX_ITEMS_PER_CALL]) for i in range(0, max(len(ops), 1), MAX_ITEMS_PER_CALL)]
        )

    async def _send_calls(self, calls: Sequence[Sequence[IndexOp]]) -> None:
        for ops in calls:
            self.log_entries = await self._apply_call(self.gid, self._next_op(), ops)
        if self.log_entries > 2 * self.mirror.indexed_count + RELOG_SLACK:
            await self._relog()

    async def _apply_call(self, gid: int, op: int, ops: Sequence[IndexOp]) -> int:
        """One apply.lua call for ``gid``; the gid's block-log length after it."""
        keys = self.keys
        kinds, args = encode_ops(ops)
        reply = await self._scripts.run(
            "apply",
            [keys.worker(self.worker_id), keys.log(gid), keys.meta],
            [gid, op, keys.block_prefix, kinds, *args],
        )
        skipped, log_entries, missing = int(reply[2]), int(reply[4]), int(reply[6])
        if skipped or missing:
            raise StaleGenerationError(
                f"Redis lacks {skipped + missing} blocks that worker {self.worker_id!r} indexed "
                "before: the index lost data; re-assert the worker"
            )
        return log_entries

    async def _relog(self) -> None:
        blocks = [add.block for add in self.mirror.indexed_in_order()]
        reply = await self._scripts.run(
            "relog",
            [self.keys.worker(self.worker_id), self.keys.log(self.gid)],
            [self.gid, self._next_op(), pack_hashes(blocks)],
        )
        self.log_entries = int(reply[1])
