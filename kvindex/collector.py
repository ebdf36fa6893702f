"""Garbage collection of a model's index, in bounded steps (what ``RedisIndex.gc`` runs).

1. Workers whose heartbeat deadline passed more than ``grace_ms`` ago are deregistered
   (gc_retire.lua): their gid is retired and their record deleted.
2. Retired gids that are due (not a re-assert's staged gid) are collected bucket by bucket
   (gc_pages.lua): the gid's page log in the bucket is read backwards a chunk at a time, and the
   gid leaves each page's lists. A gid written by the layout before pages has a block log
   instead, and gc_bucket.lua takes it out of each block key. A gid done in every bucket it
   claimed is forgotten (gc_finish.lua).

One call does at most ``budget`` units of work: one per entry removed, and one per bucket or gid
finished with nothing to remove. Entries of retired gids never count in a match, so collection is
only about memory. Every script touches only the keys it declares: the client reads what to
collect first, and each script checks it again.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvindex import calls as lua
from kvindex.cluster import RedisClient
from kvindex.codec import unpack_hashes
from kvindex.keys import BucketKeys, ModelKeys
from kvindex.redis_worker import DEAD_TTL_MS
from kvindex.replies import decode
from kvindex.scripts import ScriptCall, Scripts
from kvindex.types import GcResult

MAX_DEAD_PER_CALL = 1000  # retiring a worker is O(1); the budget bounds entry removal
MAX_DUE_PER_CALL = 1000  # retired gids looked at per call (each costs at least one unit)


@dataclass
class _Work:
    budget: int
    removed: int = 0
    emptied: Counter[str] = field(default_factory=Counter)  # meta field -> what gc emptied of it


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
    for meta_field, emptied in work.emptied.items():
        if emptied:
            await client.hincrby(keys.meta, meta_field, -emptied)
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


@dataclass(frozen=True)
class _Log:
    """One kind of a gid's log in a bucket, as gc reads it: its key, bytes per entry, the keys a
    chunk of it names, the script that collects them, and the meta field counting what it empties."""

    key: Callable[[BucketKeys, str], str]
    entry: int
    keys: Callable[[BucketKeys, bytes], list[str]]
    script: Callable[[BucketKeys, str, int, int, Sequence[str]], ScriptCall[tuple[str, ...]]]
    emptied: str


# The page log: 32 hex digits per page held, its segment's first block then its own.
PAGE_LOG = _Log(
    BucketKeys.page_log,
    32,
    lambda bucket, chunk: [bucket.segment_prefix + chunk[i : i + 16].decode() for i in range(0, len(chunk), 32)],
    lua.gc_pages,
    "pages",
)
# The block log of the layout before pages (an index being upgraded): 8-byte block hashes.
BLOCK_LOG = _Log(
    BucketKeys.log,
    8,
    lambda bucket, chunk: [bucket.block(h) for h in unpack_hashes(chunk)],
    lua.gc_bucket,
    "block_keys",
)


async def _collect_bucket(client: RedisClient, scripts: Scripts, bucket: BucketKeys, gid: str, work: _Work) -> bool:
    """Collect ``gid`` in one bucket, a chunk of its log at a time, newest first; True when done."""
    async with client.pipeline(transaction=False) as pipe:
        pipe.strlen(bucket.page_log(gid))
        pipe.strlen(bucket.log(gid))
        page_log_bytes, block_log_bytes = await pipe.execute()
    log = BLOCK_LOG if block_log_bytes and not page_log_bytes else PAGE_LOG
    while work.budget > 0:
        async with client.pipeline(transaction=False) as pipe:
            pipe.hmget(bucket.state(gid), ["c", "dead"])
            pipe.strlen(log.key(bucket, gid))
            (cursor_field, dead), log_bytes = await pipe.execute()
        if dead is not None:
            return True
        cursor = min(int(cursor_field) if cursor_field is not None else log_bytes, log_bytes)
        cursor -= cursor % log.entry
        take = min(work.budget, cursor // log.entry)
        raw = await client.getrange(log.key(bucket, gid), cursor - log.entry * take, cursor - 1) if take else b""
        chunk = raw if isinstance(raw, bytes) else raw.encode()
        status, removed, emptied, _ = await scripts.run(
            log.script(bucket, gid, cursor, DEAD_TTL_MS, log.keys(bucket, chunk))
        )
        work.removed += int(removed)
        work.emptied[log.emptied] += int(emptied)
        work.budget -= max(take, 1)
        if status == "done":
            return True
    return False
