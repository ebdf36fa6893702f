"""Garbage collection of a model's index, in bounded steps (what ``RedisIndex.gc`` runs).

1. Workers whose heartbeat deadline passed more than ``grace_ms`` ago are deregistered
   (gc_retire.lua): their gid is retired and their record deleted.
2. Retired gids that are due (not a re-assert's staged gid) are collected bucket by bucket
   (gc_bucket.lua): the gid's block log in the bucket is read backwards a chunk at a time,
   children before parents, and the gid leaves each block key. A gid done in every bucket it
   claimed is forgotten (gc_finish.lua).

One call does at most ``budget`` units of work: one per entry removed, and one per bucket or gid
finished with nothing to remove. Entries of retired gids never count in a match, so collection is
only about memory. Every script touches only the keys it declares: the client reads what to
collect first, and each script checks it again.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvindex import calls as lua
from kvindex.cluster import RedisClient
from kvindex.codec import unpack_hashes
from kvindex.keys import BucketKeys, ModelKeys
from kvindex.redis_worker import DEAD_TTL_MS
from kvindex.replies import decode
from kvindex.scripts import Scripts
from kvindex.types import GcResult

MAX_DEAD_PER_CALL = 1000  # retiring a worker is O(1); the budget bounds entry removal
MAX_DUE_PER_CALL = 1000  # retired gids looked at per call (each costs at least one unit)


@dataclass
class _Work:
    budget: int
    removed: int = 0
    gone_keys: int = 0
    pages_emptied: int = 0


async def collect(client: RedisClient, scripts: Scripts, keys: ModelKeys, budget: int, grace_ms: int) -> GcResult:
    if budget < 1:
        raise ValueError(f"gc budget must be a positive integer, got {budget}")
    if grace_ms < 0:
        raise ValueError(f"gc grace_ms must be non-negative, got {grace_ms}")
    retired = await _retire_dead(client, scripts, keys, min(budget, MAX_DEAD_PER_CALL), grace_ms)
    work = _Work(budget)
    finished = 0
    due = await scripts.run(lua.alive(keys.retired, "due", min(budget, MAX_DUE_PER_CALL)))
    for gid in (decode(g) for g in due[1:]):
        if work.budget <= 0:
            break
        if await _collect_gid(client, scripts, keys, gid, work):
            finished += await scripts.run(lua.gc_finish(keys, gid))
    if work.gone_keys:
        await client.hincrby(keys.meta, "block_keys", -work.gone_keys)
    if work.pages_emptied:
        await client.hincrby(keys.meta, "pages", -work.pages_emptied)
    pending = await client.zcard(keys.retired)
    return GcResult(retired, work.removed, finished, int(pending))


async def _retire_dead(client: RedisClient, scripts: Scripts, keys: ModelKeys, limit: int, grace_ms: int) -> int:
    dead = [decode(g) for g in (await scripts.run(lua.alive(keys.alive, "dead", limit, grace_ms)))[1:]]
    if not dead:
        return 0
    owners = [decode(w) if w is not None else None for w in await client.hmget(keys.gids, dead)]
    # A gid nobody owns still leaves `alive`; its record slot is the bare prefix, never a record.
    records = [keys.worker(owner) if owner else keys.worker_prefix for owner in owners]
    return await scripts.run(lua.gc_retire(keys, grace_ms, dead, records))


async def _collect_gid(client: RedisClient, scripts: Scripts, keys: ModelKeys, gid: str, work: _Work) -> bool:
    """Collect ``gid`` in each bucket it claimed, within the budget; True when it is done everywhere."""
    buckets = sorted(int(b) for b in await client.smembers(keys.gid_buckets(gid)))
    if not buckets:
        work.budget -= 1  # nothing to remove: finishing the gid is the unit of work
        return True
    for bucket in buckets:
        if not await _collect_bucket(client, scripts, keys.bucket(bucket), gid, work):
            return False
    return True


async def _collect_bucket(client: RedisClient, scripts: Scripts, bucket: BucketKeys, gid: str, work: _Work) -> bool:
    while work.budget > 0:
        async with client.pipeline(transaction=False) as pipe:
            pipe.hmget(bucket.state(gid), ["c", "dead"])
            pipe.strlen(bucket.log(gid))
            pipe.strlen(bucket.page_log(gid))
            (cursor_field, dead), log_bytes, page_log_bytes = await pipe.execute()
        if dead is not None:
            return True
        if page_log_bytes or not log_bytes:
            return await _collect_pages(client, scripts, bucket, gid, work)
        # A gid written by the layout before pages (an index being upgraded): its block log.
        cursor = min(int(cursor_field) if cursor_field is not None else log_bytes, log_bytes)
        cursor -= cursor % 8
        take = min(work.budget, cursor // 8)
        chunk = await client.getrange(bucket.log(gid), cursor - 8 * take, cursor - 1) if take else b""
        block_keys = [bucket.block(h) for h in unpack_hashes(chunk if isinstance(chunk, bytes) else chunk.encode())]
        status, removed, gone, _ = await scripts.run(lua.gc_bucket(bucket, gid, cursor, DEAD_TTL_MS, block_keys))
        work.removed += int(removed)
        work.gone_keys += int(gone)
        work.budget -= max(take, 1)
        if status == "done":
            return True
    return False


PAGE_ENTRY = 32  # a page log entry: the segment's first block and the page's, in hex


async def _collect_pages(client: RedisClient, scripts: Scripts, bucket: BucketKeys, gid: str, work: _Work) -> bool:
    """Collect ``gid``'s holdings in one bucket of the page layout, a chunk of its page log at a time."""
    while work.budget > 0:
        async with client.pipeline(transaction=False) as pipe:
            pipe.hmget(bucket.state(gid), ["c", "dead"])
            pipe.strlen(bucket.page_log(gid))
            (cursor_field, dead), log_bytes = await pipe.execute()
        if dead is not None:
            return True
        cursor = min(int(cursor_field) if cursor_field is not None else log_bytes, log_bytes)
        cursor -= cursor % PAGE_ENTRY
        take = min(work.budget, cursor // PAGE_ENTRY)
        raw = await client.getrange(bucket.page_log(gid), cursor - PAGE_ENTRY * take, cursor - 1) if take else b""
        chunk = raw.decode() if isinstance(raw, bytes) else raw
        segments = [bucket.segment_prefix + chunk[i : i + 16] for i in range(0, len(chunk), PAGE_ENTRY)]
        status, removed, emptied, _ = await scripts.run(lua.gc_pages(bucket, gid, cursor, DEAD_TTL_MS, segments))
        work.removed += int(removed)
        work.pages_emptied += int(emptied)
        work.budget -= max(take, 1)
        if status == "done":
            return True
    return False
