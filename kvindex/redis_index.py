"""The shared index in Redis: every write and every match is one atomic Lua script call.

Writers (worker agents) register a worker and get its :class:`~kvindex.redis_worker.RedisWorker`
handle, which keeps the worker's :class:`~kvindex.mirror.BlockMirror`, gid and op ids and sends
only the resulting index operations; the ``(model, worker_id)`` write methods here are shorthands
that look the handle up. Readers (routers) are stateless apart from a cache of gid -> worker id
names, which never change: gids are random and never handed out again, even after Redis lost
its data (see kvindex.generations).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from kvindex.codec import pack_hashes
from kvindex.errors import NotRegisteredError
from kvindex.generations import register_worker, retire
from kvindex.interface import DEFAULT_GC_BUDGET, DEFAULT_GC_GRACE_MS, DEFAULT_TTL_MS
from kvindex.keys import KeySchema, ModelKeys
from kvindex.mirror import BlockMirror
from kvindex.redis_worker import MAX_ITEMS_PER_CALL, RELOG_SLACK, RedisWorker
from kvindex.replies import (
    block_owners,
    decode,
    depths_from_match_reply,
    raise_script_error,
    time_ms,
    worker_record,
)
from kvindex.scripts import ScriptCall, Scripts
from kvindex.types import (
    BlockChange,
    GcResult,
    HeartbeatStatus,
    ModelStats,
    Registration,
    StoredRun,
    WorkerInfo,
    WorkerLoad,
    WorkerRecord,
    WriteResult,
)

MAX_CACHED_NAMES = 100_000

__all__ = ["MAX_ITEMS_PER_CALL", "RELOG_SLACK", "RedisIndex", "RedisWorker"]


class RedisIndex:
    """:class:`kvindex.interface.KVIndex` backed by Redis (or Valkey, or Redis Cluster)."""

    def __init__(self, client: Redis, schema: KeySchema | None = None) -> None:
        self._client = client
        self._schema = schema or KeySchema()
        self._scripts = Scripts(client)
        self._handles: dict[tuple[str, str], RedisWorker] = {}
        self._gid_names: dict[tuple[str, int], str] = {}

    @property
    def scripts(self) -> Scripts:
        return self._scripts

    def keys(self, model: str) -> ModelKeys:
        return self._schema.for_model(model)

    # --- writers ----------------------------------------------------------------------------

    async def register(self, worker: WorkerInfo, ttl_ms: int = DEFAULT_TTL_MS) -> RedisWorker:
        """Register ``worker`` with an empty block set (any previous generation is retired) and
        return its handle; a handle this client held for the same worker is closed."""
        registration = await register_worker(self._client, self._scripts, self._schema, worker, ttl_ms)
        key = (worker.model, worker.worker_id)
        previous = self._handles.get(key)
        if previous is not None:
            previous.close()
        handle = RedisWorker(self._client, self._scripts, self._schema, worker, ttl_ms, registration, self._closed)
        self._handles[key] = handle
        return handle

    def _closed(self, handle: RedisWorker) -> None:
        key = (handle.model, handle.worker_id)
        if self._handles.get(key) is handle:
            del self._handles[key]

    def handle(self, model: str, worker_id: str) -> RedisWorker:
        """The handle of a worker this client registered (NotRegisteredError otherwise)."""
        handle = self._handles.get((model, worker_id))
        if handle is None:
            raise NotRegisteredError(f"worker {worker_id!r} of model {model!r} was not registered through this client")
        return handle

    # Shorthands: the same writes by (model, worker id), through the worker's handle.

    def mirror(self, model: str, worker_id: str) -> BlockMirror:
        return self.handle(model, worker_id).mirror

    def needs_reassert(self, model: str, worker_id: str) -> bool:
        return self.handle(model, worker_id).needs_reassert()

    async def reassert(self, model: str, worker_id: str) -> Registration:
        return await self.handle(model, worker_id).reassert()

    async def heartbeat(self, model: str, worker_id: str, ttl_ms: int = DEFAULT_TTL_MS) -> HeartbeatStatus:
        return await self.handle(model, worker_id).heartbeat(ttl_ms)

    async def report_load(self, model: str, worker_id: str, load: WorkerLoad) -> HeartbeatStatus:
        return await self.handle(model, worker_id).report_load(load)

    async def store(self, model: str, worker_id: str, runs: Sequence[StoredRun]) -> WriteResult:
        return await self.handle(model, worker_id).store(runs)

    async def remove(self, model: str, worker_id: str, blocks: Sequence[int]) -> WriteResult:
        return await self.handle(model, worker_id).remove(blocks)

    async def apply(self, model: str, worker_id: str, changes: Sequence[BlockChange]) -> WriteResult:
        return await self.handle(model, worker_id).apply(changes)

    async def clear(self, model: str, worker_id: str) -> None:
        await self.handle(model, worker_id).clear()

    async def deregister(self, model: str, worker_id: str) -> None:
        await self.handle(model, worker_id).deregister()

    async def indexed_blocks(self, model: str, worker_id: str) -> int | None:
        return await self.handle(model, worker_id).indexed_blocks()

    # --- operator actions ---------------------------------------------------------------------

    async def evict(self, model: str, worker_id: str) -> bool:
        """Remove a worker whoever registered it. True if it was registered."""
        status, _ = await retire(self._scripts, self.keys(model), worker_id, "leave", "")
        handle = self._handles.get((model, worker_id))
        if handle is not None:
            handle.close()
        return decode(status) == "ok"  # type: ignore[arg-type]

    async def gc(self, model: str, budget: int = DEFAULT_GC_BUDGET, grace_ms: int = DEFAULT_GC_GRACE_MS) -> GcResult:
        keys = self.keys(model)
        reply = await self._scripts.run(
            "gc",
            [keys.workers, keys.gids, keys.alive, keys.retired, keys.gc_cursors, keys.meta],
            [keys.worker_prefix, keys.log_prefix, keys.block_prefix, budget, grace_ms],
        )
        return GcResult(*(int(v) for v in reply))

    # --- reads ------------------------------------------------------------------------------

    async def match(self, model: str, chain: Sequence[int]) -> dict[str, int]:
        name, keys, args = self.match_call(model, chain)
        return await self.match_result(model, await self._scripts.run(name, keys, args))

    def match_call(self, model: str, chain: Sequence[int]) -> ScriptCall:
        """:meth:`match` as a script call, for callers that batch it with others."""
        keys = self.keys(model)
        return ("match", [keys.alive], [keys.block_prefix, pack_hashes(chain).hex()])

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
        if unknown and len(self._gid_names) > MAX_CACHED_NAMES:
            self._gid_names.clear()  # gids of workers long gone; the ones in use are read again
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
        """Alive workers that hold ``block`` in the index, each with 1 (the index records who
        holds a block; copies are counted by each writer's mirror)."""
        return (await self.owners_of_chain(model, [block]))[0]

    async def owners_of_chain(self, model: str, chain: Sequence[int]) -> list[dict[str, int]]:
        """:meth:`owners` of every block of a chain, in one pipelined round trip."""
        alive = await self._alive_gids(model)
        keys = self.keys(model)
        async with self._client.pipeline(transaction=False) as pipe:
            for block in chain:
                pipe.smembers(keys.block(block))
            replies = await pipe.execute()
        held = [block_owners(members, alive) for members in replies]
        names = await self._worker_names(model, sorted({gid for h in held for gid in h}))
        return [{names[gid]: copies for gid, copies in h.items() if gid in names} for h in held]

    async def server_run_id(self) -> str | None:
        """The Redis process's run_id: it changes when the server restarts or fails over. None
        when INFO has none (some proxies and managed services leave it out)."""
        info = await self._client.info("server")
        run_id = info.get("run_id")
        return None if run_id is None else str(run_id)

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
