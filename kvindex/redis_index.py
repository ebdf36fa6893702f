"""The shared index in Redis: every write and every match is one atomic Lua script call.

Writers (worker agents) register a worker and get its :class:`~kvindex.redis_worker.RedisWorker`
handle, which keeps the worker's :class:`~kvindex.mirror.BlockMirror`, gid and op ids and sends
only the resulting index operations (``handle(model, worker_id)`` finds it again; the index
itself has no write methods: one owner of a worker's writes). Readers (routers) are stateless
apart from a cache of gid -> worker id names, which never change: gids are random and never
handed out again, even after Redis lost its data (see kvindex.generations).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from redis.exceptions import ResponseError

from kvindex import calls as lua
from kvindex.alive_cache import AliveCache
from kvindex.cluster import RedisClient, is_cluster
from kvindex.collector import collect
from kvindex.errors import NotRegisteredError
from kvindex.generations import register_worker, retire
from kvindex.interface import DEFAULT_GC_BUDGET, DEFAULT_GC_GRACE_MS, DEFAULT_TTL_MS
from kvindex.keys import KeySchema, ModelKeys
from kvindex.pages import Page, combine_listed, pages_of, segments
from kvindex.redis_worker import MAX_PAGES_PER_CALL, RELOG_SLACK, RedisWorker
from kvindex.replies import decode, raise_script_error, worker_record
from kvindex.scripts import ScriptCall, Scripts
from kvindex.servers import server_memory, server_run_id
from kvindex.types import (
    GcResult,
    ModelStats,
    WorkerInfo,
    WorkerRecord,
)

MAX_CACHED_NAMES = 100_000

__all__ = ["MAX_PAGES_PER_CALL", "RELOG_SLACK", "RedisIndex", "RedisWorker"]


class _NamedGids(NamedTuple):
    """A model's alive gids with their worker ids, and every one of those at depth 0."""

    alive: frozenset[int]
    listed: dict[bytes, str]  # gid as page_match.lua lists it -> worker id
    zeros: dict[str, int]


class RedisIndex:
    """:class:`kvindex.interface.KVIndex` backed by Redis (or Valkey, or Redis Cluster)."""

    def __init__(self, client: RedisClient, schema: KeySchema | None = None) -> None:
        self._client = client
        self._schema = schema or KeySchema()
        self._scripts = Scripts(client)
        self._handles: dict[tuple[str, str], RedisWorker] = {}
        self._gid_names: dict[tuple[str, int], str] = {}
        self._alive = AliveCache()
        self._alive_named: dict[str, _NamedGids] = {}
        self._pages_memo: tuple[Sequence[int], int, int | None, list[Page]] | None = None
        self._cluster = is_cluster(client)

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

    # --- operator actions ---------------------------------------------------------------------

    async def evict(self, model: str, worker_id: str) -> bool:
        """Remove a worker whoever registered it. True if it was registered."""
        status, _ = await retire(self._scripts, self.keys(model), worker_id, "leave", "")
        handle = self._handles.get((model, worker_id))
        if handle is not None:
            handle.close()
        return decode(status) == "ok"  # type: ignore[arg-type]

    async def gc(self, model: str, budget: int = DEFAULT_GC_BUDGET, grace_ms: int = DEFAULT_GC_GRACE_MS) -> GcResult:
        return await collect(self._client, self._scripts, self.keys(model), budget, grace_ms)

    # --- reads ------------------------------------------------------------------------------

    async def match(self, model: str, chain: Sequence[int]) -> dict[str, int]:
        calls = self.match_calls(model, chain)
        return await self.match_result(model, chain, await self._scripts.call_many(calls))

    def match_calls(self, model: str, chain: Sequence[int]) -> list[ScriptCall]:
        """:meth:`match` as script calls, for callers that batch them with others: the model's
        alive gids first (alive_since.lua, which answers in two values while this client's copy
        holds: kvindex.alive_cache), then the chain's pages (page_match.lua): on a single Redis
        one call that walks them in order; on a cluster one call per segment key, run at once on
        their shards and combined exactly by :meth:`match_result`. Build them for each match:
        the first carries the copy's version."""
        keys = self.keys(model)
        return [self._alive.call(keys), *self._page_calls(keys, chain)]

    def _pages(self, chain: Sequence[int]) -> list[Page]:
        """``chain``'s pages, kept from :meth:`match_calls` for its :meth:`match_result` (the same
        list object, of the same length and last block) in the common case of one match at a time."""
        memo = self._pages_memo
        if memo is not None and memo[0] is chain and memo[1] == len(chain) and (not chain or memo[2] == chain[-1]):
            return memo[3]
        pages = pages_of(chain)
        self._pages_memo = (chain, len(chain), chain[-1] if chain else None, pages)
        return pages

    def _page_calls(self, keys: ModelKeys, chain: Sequence[int]) -> list[ScriptCall]:
        pages = self._pages(chain)
        if not pages:
            return []
        if not self._cluster:
            return [lua.page_match(keys, pages, chain, chained=True)]
        calls, at = [], 0
        for _, count in segments(pages):
            calls.append(lua.page_match(keys, pages[at : at + count], chain, chained=False))
            at += count
        return calls

    def alive_call(self, model: str) -> ScriptCall:
        """The first of :meth:`match_calls` alone, for callers that built the match call once."""
        return self._alive.call(self.keys(model))

    async def match_result(self, model: str, chain: Sequence[int], replies: Sequence[Any]) -> dict[str, int]:
        """The replies of :meth:`match_calls` for ``chain`` -> {alive worker id: matched blocks}."""
        _raise_failures(replies)
        named = await self._named(model, await self._alive_from(model, replies[0]))
        depths = dict(named.zeros)
        pages = [page for reply in replies[1:] for page in reply]
        for gid, depth in combine_listed(self._pages(chain), pages).items():
            name = named.listed.get(gid)
            if name is not None:
                depths[name] = depth
        return depths

    async def _named(self, model: str, alive: frozenset[int]) -> _NamedGids:
        """The worker ids of ``alive``, kept for the next match while the alive set is the same
        object (kvindex.alive_cache hands out one set while its copy holds)."""
        held = self._alive_named.get(model)
        if held is not None and held.alive is alive:
            return held
        names = await self._worker_names(model, list(alive))
        listed = {str(gid).encode(): name for gid, name in names.items()}
        named = _NamedGids(alive, listed, dict.fromkeys(names.values(), 0))
        if len(names) == len(alive):  # else a name not written yet: looked up again next time
            self._alive_named[model] = named
        return named

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

    async def _alive_gids(self, model: str) -> frozenset[int]:
        return await self._alive_from(model, await self._scripts.run(self._alive.call(self.keys(model))))

    async def _alive_from(self, model: str, reply: Any) -> frozenset[int]:
        """The liveness read's reply (alive_since.lua's, or the version's GET) -> the gids alive
        at its time, reading the whole set again in the rare case the copy it confirms was
        dropped meanwhile (many refreshes in flight) or may have lapsed (kvindex.alive_cache)."""
        alive = self._alive.alive(model, reply)
        while alive is None:
            alive = self._alive.alive(model, await self._scripts.run(self._alive.whole_call(self.keys(model))))
        return alive

    async def group_holders(self, model: str, names: Sequence[int]) -> list[set[str]]:
        """Per name, the alive workers that hold it as a one-block chain (a hybrid model's window
        groups, kvindex/groups.py): its page's ``e:`` field, the gids whose holding ends there
        (page_apply.lua), one HGET each, sent with the liveness read in one batch."""
        keys = self.keys(model)
        replies = await self._scripts.call_many([self._alive.call(keys), *(lua.group_holders(keys, n) for n in names)])
        _raise_failures(replies)
        named = await self._named(model, await self._alive_from(model, replies[0]))
        out = []
        for reply in replies[1:]:
            gids = reply.split(b",") if reply else []
            out.append({named.listed[g] for g in gids if g in named.listed})
        return out

    async def owners(self, model: str, block: int, chain: Sequence[int] | None = None) -> dict[str, int]:
        """Alive workers that hold ``block`` and its ancestors, each with 1 (the index records who
        holds a block; copies are counted by each writer's mirror). The page layout finds a
        block by its chain: ``chain`` is the chain's blocks from its first through ``block``."""
        if not chain or chain[-1] != block:
            raise ValueError("owners needs the block's chain, from its first block through the block")
        return (await self.owners_of_chain(model, chain))[-1]

    async def owners_of_chain(self, model: str, chain: Sequence[int]) -> list[dict[str, int]]:
        """:meth:`owners` of every block of a chain, from one match."""
        if not chain:
            await self._alive_gids(model)  # the same errors as a match (a wrong password, a bad model)
            return []
        depths = await self.match(model, chain)
        return [{w: 1 for w, d in depths.items() if d > i} for i in range(len(chain))]

    async def server_run_id(self) -> str | None:
        """The Redis process's run_id: it changes when the server restarts or fails over. On a
        cluster, the run ids of all masters together: any master that restarts, or a replica
        promoted in its place, changes it. None when INFO has none (some proxies and managed
        services leave it out)."""
        return await server_run_id(self._client)

    async def server_memory(self) -> dict[str, int]:
        """Redis's own view of its size (summed over a cluster's masters), for `kvroute index stats`."""
        return await server_memory(self._client)

    async def block_size(self, model: str) -> int | None:
        value = await self._client.hget(self.keys(model).meta, "block_size")
        return int(value) if value is not None else None

    async def models(self) -> list[str]:
        return sorted(decode(m) for m in await self._client.smembers(self._schema.models))

    async def workers(self, model: str) -> list[WorkerRecord]:
        keys = self.keys(model)
        worker_ids = sorted(decode(w) for w in await self._client.hkeys(keys.workers))
        now, *alive = await self._scripts.run(lua.alive(keys.alive, "all"))
        async with self._client.pipeline(transaction=False) as pipe:
            for worker_id in worker_ids:
                pipe.hgetall(keys.worker(worker_id))
            records = await pipe.execute()
        now_ms = int(now)
        deadlines = {int(alive[i]): float(alive[i + 1]) for i in range(0, len(alive), 2)}
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
            pages=int(meta.get("pages", 0)),
        )


def _raise_failures(replies: Sequence[Any]) -> None:
    """A batch's first failed reply, raised (a script's ``kvroute:`` error as kvindex.errors says)."""
    for reply in replies:
        if isinstance(reply, ResponseError):
            raise_script_error(reply)
        if isinstance(reply, Exception):
            raise reply
