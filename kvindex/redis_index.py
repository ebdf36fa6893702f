"""The shared index in Redis: every write and every match is one atomic Lua script call.

Writers (worker agents) keep a :class:`~kvindex.mirror.BlockMirror` per worker they registered
and send only the resulting index operations; readers (routers) are stateless apart from a
cache of gid -> worker id names, which never change.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError, ResponseError

from kvindex.codec import encode_ops, pack_hashes
from kvindex.errors import (
    NotRegisteredError,
    StaleGenerationError,
)
from kvindex.interface import DEFAULT_GC_BUDGET, DEFAULT_GC_GRACE_MS, DEFAULT_TTL_MS
from kvindex.keys import KeySchema, ModelKeys
from kvindex.mirror import BlockMirror, IndexOp
from kvindex.replies import decode, depths_from_match_reply, raise_script_error, time_ms, worker_record
from kvindex.scripts import ScriptCall, Scripts
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
)

# Items per apply.lua call: keeps each script run around a few milliseconds.
MAX_ITEMS_PER_CALL = 4096
# Rewrite a gid's block log once it lists this many more entries than the gid holds.
RELOG_SLACK = 1024


@dataclass
class _Writer:
    """What this client knows about a worker it registered."""

    info: WorkerInfo
    keys: ModelKeys
    gid: int
    ttl_ms: int
    op: int = 0
    mirror: BlockMirror = field(default_factory=BlockMirror)
    log_entries: int = 0
    dirty: bool = False  # a write failed: Redis may lack part of the mirror until reassert()
    load: WorkerLoad | None = None

    def next_op(self) -> int:
        self.op += 1
        return self.op


class RedisIndex:
    """:class:`kvindex.interface.KVIndex` backed by Redis (or Valkey, or Redis Cluster)."""

    def __init__(self, client: Redis, schema: KeySchema | None = None) -> None:
        self._client = client
        self._schema = schema or KeySchema()
        self._scripts = Scripts(client)
        self._writers: dict[tuple[str, str], _Writer] = {}
        self._gid_names: dict[tuple[str, int], str] = {}

    @property
    def scripts(self) -> Scripts:
        return self._scripts

    def keys(self, model: str) -> ModelKeys:
        return self._schema.for_model(model)

    async def _call(self, name: str, keys: Sequence[str | bytes | int], args: Sequence[str | bytes | int]) -> Any:
        try:
            return await self._scripts.call(name, keys, args)
        except ResponseError as exc:
            raise_script_error(exc)
            raise  # pragma: no cover - _raise_script_error always raises

    def _writer(self, model: str, worker_id: str) -> _Writer:
        writer = self._writers.get((model, worker_id))
        if writer is None:
            raise NotRegisteredError(f"worker {worker_id!r} of model {model!r} was not registered through this client")
        return writer

    def mirror(self, model: str, worker_id: str) -> BlockMirror:
        return self._writer(model, worker_id).mirror

    # --- writes -----------------------------------------------------------------------------

    async def register(self, worker: WorkerInfo, ttl_ms: int = DEFAULT_TTL_MS) -> Registration:
        """Register ``worker`` with an empty block set (any previous generation is retired)."""
        keys = self.keys(worker.model)
        keys.worker(worker.worker_id)  # validates the id
        gid, epoch = await self._call(
            "register",
            [keys.meta, keys.workers, keys.gids, keys.alive, keys.retired, keys.worker(worker.worker_id)],
            [worker.worker_id, worker.url, worker.model, worker.block_size, worker.dp_rank, ttl_ms],
        )
        await self._client.sadd(self._schema.models, worker.model)
        self._writers[(worker.model, worker.worker_id)] = _Writer(worker, keys, int(gid), ttl_ms)
        return Registration(int(gid), int(epoch))

    def needs_reassert(self, model: str, worker_id: str) -> bool:
        """True after a write failed: Redis may lack changes the mirror has."""
        return self._writer(model, worker_id).dirty

    async def reassert(self, model: str, worker_id: str) -> Registration:
        """Register again under a fresh generation and write the whole mirror back: used when
        Redis lost data (restart, failover, flush), a write failed, or to heal drift."""
        writer = self._writer(model, worker_id)
        registration = await self.register(writer.info, writer.ttl_ms)
        fresh = self._writer(model, worker_id)
        fresh.mirror, fresh.load = writer.mirror, writer.load
        try:
            await self._send(fresh, list(fresh.mirror.indexed_in_order()))
            if fresh.load is not None:
                await self.report_load(model, worker_id, fresh.load)
        except (RedisError, OSError, StaleGenerationError):
            fresh.dirty = True
            raise
        return registration

    async def heartbeat(self, model: str, worker_id: str, ttl_ms: int = DEFAULT_TTL_MS) -> HeartbeatStatus:
        writer = self._writer(model, worker_id)
        writer.ttl_ms = ttl_ms
        keys = writer.keys
        status = await self._call("heartbeat", [keys.worker(worker_id), keys.alive], [writer.gid, ttl_ms])
        return HeartbeatStatus(decode(status))

    async def report_load(self, model: str, worker_id: str, load: WorkerLoad) -> HeartbeatStatus:
        writer = self._writer(model, worker_id)
        writer.load = load
        status = await self._call(
            "load", [writer.keys.worker(worker_id)], [writer.gid, load.running, load.waiting, repr(load.kv_usage)]
        )
        return HeartbeatStatus(decode(status))

    async def store(self, model: str, worker_id: str, runs: Sequence[StoredRun]) -> WriteResult:
        return await self.apply(model, worker_id, runs)

    async def remove(self, model: str, worker_id: str, blocks: Sequence[int]) -> WriteResult:
        return await self.apply(model, worker_id, [RemovedBlocks(tuple(blocks))])

    async def apply(self, model: str, worker_id: str, changes: Sequence[BlockChange]) -> WriteResult:
        """Apply stores and removals in order: one apply.lua call (unless above
        MAX_ITEMS_PER_CALL items), so readers see all of it or none of it.

        The mirror is updated first. If Redis cannot be reached, the writer is marked dirty:
        later calls only update the mirror, and :meth:`reassert` (which the agent retries until
        it succeeds) writes everything back. A StaleGenerationError (Redis lost data, or another
        registration took over) is raised and also calls for :meth:`reassert`."""
        writer = self._writer(model, worker_id)
        ops, result = writer.mirror.apply(changes)
        if writer.dirty:
            return result
        try:
            await self._send(writer, ops)
        except (RedisError, OSError) as exc:
            if not isinstance(exc, ResponseError):
                writer.dirty = True  # unknown whether Redis applied it
            raise
        return result

    async def _send(self, writer: _Writer, ops: Sequence[IndexOp]) -> None:
        keys = writer.keys
        # Even an empty batch goes to Redis: it checks that this writer's generation is current.
        for start in range(0, max(len(ops), 1), MAX_ITEMS_PER_CALL):
            kinds, args = encode_ops(ops[start : start + MAX_ITEMS_PER_CALL])
            reply = await self._call(
                "apply",
                [keys.worker(writer.info.worker_id), keys.log(writer.gid), keys.meta],
                [writer.gid, writer.next_op(), keys.block_prefix, kinds, *args],
            )
            skipped, log_entries, missing = int(reply[2]), int(reply[4]), int(reply[6])
            if skipped or missing:
                raise StaleGenerationError(
                    f"Redis lacks {skipped + missing} blocks that worker {writer.info.worker_id!r} indexed "
                    "before: the index lost data; re-assert the worker"
                )
            writer.log_entries = log_entries
        if writer.log_entries > 2 * writer.mirror.indexed_count + RELOG_SLACK:
            await self._relog(writer)

    async def _relog(self, writer: _Writer) -> None:
        blocks = [add.block for add in writer.mirror.indexed_in_order()]
        reply = await self._call(
            "relog",
            [writer.keys.worker(writer.info.worker_id), writer.keys.log(writer.gid)],
            [writer.gid, writer.next_op(), pack_hashes(blocks)],
        )
        writer.log_entries = int(reply[1])

    async def _retire(self, model: str, worker_id: str, mode: str, gid: int | str) -> list[object]:
        keys = self.keys(model)
        return await self._call(
            "clear",
            [keys.meta, keys.workers, keys.gids, keys.alive, keys.retired, keys.worker(worker_id)],
            [worker_id, gid, mode],
        )

    async def clear(self, model: str, worker_id: str) -> None:
        """Drop all of the worker's blocks (it stays registered, under a fresh generation)."""
        writer = self._writer(model, worker_id)
        writer.mirror.clear()
        if writer.dirty:
            return
        try:
            status, gid = await self._retire(model, worker_id, "keep", writer.gid)
        except (RedisError, OSError) as exc:
            if not isinstance(exc, ResponseError):
                writer.dirty = True
            raise
        if decode(status) != "ok":  # type: ignore[arg-type]
            raise StaleGenerationError(f"worker {worker_id!r} is {decode(status)} in the index")  # type: ignore[arg-type]
        writer.gid, writer.op, writer.log_entries = int(gid), 0, 0  # type: ignore[call-overload]

    async def deregister(self, model: str, worker_id: str) -> None:
        writer = self._writer(model, worker_id)
        await self._retire(model, worker_id, "leave", writer.gid)
        del self._writers[(model, worker_id)]

    async def evict(self, model: str, worker_id: str) -> bool:
        """Operator action: remove a worker whoever registered it. True if it was registered."""
        status, _ = await self._retire(model, worker_id, "leave", "")
        self._writers.pop((model, worker_id), None)
        return decode(status) == "ok"  # type: ignore[arg-type]

    async def gc(self, model: str, budget: int = DEFAULT_GC_BUDGET, grace_ms: int = DEFAULT_GC_GRACE_MS) -> GcResult:
        keys = self.keys(model)
        reply = await self._call(
            "gc",
            [keys.workers, keys.gids, keys.alive, keys.retired, keys.gc_cursors, keys.meta],
            [keys.worker_prefix, keys.log_prefix, keys.block_prefix, budget, grace_ms],
        )
        return GcResult(*(int(v) for v in reply))

    # --- reads ------------------------------------------------------------------------------

    async def match(self, model: str, chain: Sequence[int]) -> dict[str, int]:
        name, keys, args = self.match_call(model, chain)
        return await self.match_result(model, await self._call(name, keys, args))

    def match_call(self, model: str, chain: Sequence[int]) -> ScriptCall:
        """:meth:`match` as a script call, for callers that batch it with others."""
        keys = self.keys(model)
        return ("match", [keys.alive], [keys.block_prefix, pack_hashes(chain)])

    async def match_result(self, model: str, reply: Any) -> dict[str, int]:
        if isinstance(reply, ResponseError):
            raise_script_error(reply)
        if isinstance(reply, Exception):
            raise reply
        depths = depths_from_match_reply(reply)
        names = await self._worker_names(model, list(depths))
        return {names[gid]: depth for gid, depth in depths.items() if gid in names}

    async def _worker_names(self, model: str, gids: Sequence[int]) -> dict[int, str]:
        unknown = [gid for gid in gids if (model, gid) not in self._gid_names]
        if unknown:
            values = await self._client.hmget(self.keys(model).gids, [str(g) for g in unknown])
            for gid, name in zip(unknown, values, strict=True):
                if name is not None:
                    self._gid_names[(model, gid)] = decode(name)
        return {gid: self._gid_names[(model, gid)] for gid in gids if (model, gid) in self._gid_names}

    async def _alive_gids(self, model: str) -> set[int]:
        keys = self.keys(model)
        async with self._client.pipeline(transaction=False) as pipe:
            pipe.time()
            pipe.zrange(keys.alive, 0, -1, withscores=True)
            server_time, entries = await pipe.execute()
        now_ms = time_ms(server_time)
        return {int(gid) for gid, deadline in entries if deadline > now_ms}

    async def owners(self, model: str, block: int) -> dict[str, int]:
        """Alive workers that hold ``block`` in the index, with their copy counts."""
        return (await self.owners_of_chain(model, [block]))[0]

    async def owners_of_chain(self, model: str, chain: Sequence[int]) -> list[dict[str, int]]:
        """:meth:`owners` of every block of a chain, in one pipelined round trip."""
        alive = await self._alive_gids(model)
        keys = self.keys(model)
        async with self._client.pipeline(transaction=False) as pipe:
            for block in chain:
                pipe.zrange(keys.block(block), 0, -1, withscores=True)
            replies = await pipe.execute()
        held = [{int(gid): int(score) for gid, score in entries if int(gid) in alive} for entries in replies]
        names = await self._worker_names(model, sorted({gid for h in held for gid in h}))
        return [{names[gid]: copies for gid, copies in h.items() if gid in names} for h in held]

    async def indexed_blocks(self, model: str, worker_id: str) -> int | None:
        """How many blocks Redis indexes for this writer's current generation (None when the
        record is gone or belongs to another generation): compared with the mirror to find drift."""
        writer = self._writer(model, worker_id)
        gid, blocks = await self._client.hmget(writer.keys.worker(worker_id), ["gid", "blocks"])
        if gid is None or int(gid) != writer.gid:
            return None
        return int(blocks or 0)

    async def server_run_id(self) -> str:
        """The Redis process's run_id: it changes when the server restarts or fails over."""
        info = await self._client.info("server")
        return str(info["run_id"])

    async def server_memory(self) -> dict[str, int]:
        """Redis's own view of its size, for `kvroute index stats`."""
        info = await self._client.info("memory")
        return {"used_memory": int(info["used_memory"]), "keys": int(await self._client.dbsize())}

    async def block_size(self, model: str) -> int | None:
        value = await self._client.hget(self.keys(model).meta, "block_size")
        return int(value) if value is not None else None

    async def models(self) -> list[str]:
        return sorted(decode(m) for m in await self._client.smembers(self._schema.models))

    async def workers(self, model: str) -> list[WorkerRecord]:
        keys = self.keys(model)
        worker_ids = sorted(decode(w) for w in await self._client.hkeys(keys.workers))
        async with self._client.pipeline(transaction=False) as pipe:
            pipe.time()
            pipe.zrange(keys.alive, 0, -1, withscores=True)
            for worker_id in worker_ids:
                pipe.hgetall(keys.worker(worker_id))
            server_time, alive, *records = await pipe.execute()
        now_ms = time_ms(server_time)
        deadlines = {int(gid): deadline for gid, deadline in alive}
        out = []
        for raw in records:
            if raw:  # empty when deregistered between the two reads
                out.append(worker_record({decode(k): decode(v) for k, v in raw.items()}, deadlines, now_ms))
        return out

    async def stats(self, model: str) -> ModelStats:
        keys = self.keys(model)
        records = await self.workers(model)
        meta = {decode(k): decode(v) for k, v in (await self._client.hgetall(keys.meta)).items()}
        return ModelStats(
            model=model,
            block_size=int(meta["block_size"]) if "block_size" in meta else None,
            workers=len(records),
            alive_workers=sum(r.alive for r in records),
            entries=sum(r.blocks for r in records),
            block_keys=int(meta.get("block_keys", 0)),
            gids_pending_gc=await self._client.zcard(keys.retired),
        )
