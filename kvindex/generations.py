"""Worker generations (gids): how they are drawn, registered, retired and swapped.

A gid names one generation of one worker's blocks in the block keys. Routers cache gid -> worker
id for good, so a gid must never come back for another worker, even after Redis lost its data
(an empty restart, a FLUSHALL, a failover that lost the last writes). A counter in Redis would be
rewound by exactly those events; a gid is therefore drawn at random by the client, uniformly from
[2^32, 2^52): exact as a Lua number (< 2^53), and register.lua / clear.lua refuse one the model
still knows (the caller draws again). Two draws collide with probability 2^-52 per pair.
"""

from __future__ import annotations

import secrets

from kvindex import calls as lua
from kvindex.cluster import RedisClient
from kvindex.keys import KeySchema, ModelKeys
from kvindex.scripts import Scripts
from kvindex.types import Registration, WorkerInfo

GID_MIN = 1 << 32
GID_MAX = 1 << 52  # exclusive
# Draws per call before giving up: a second one is already a 2^-52 event unless Redis misbehaves.
MAX_GID_DRAWS = 8


def new_gid() -> int:
    """A fresh random gid in [GID_MIN, GID_MAX)."""
    return GID_MIN + secrets.randbelow(GID_MAX - GID_MIN)


class GidDrawsExhaustedError(RuntimeError):
    """Redis refused MAX_GID_DRAWS random gids in a row (it should never happen)."""


async def register_worker(
    client: RedisClient, scripts: Scripts, schema: KeySchema, worker: WorkerInfo, ttl_ms: int
) -> Registration:
    """register.lua (a fresh, empty generation under a random gid; any previous one is retired),
    then the model joins the ``models`` set."""
    keys = schema.for_model(worker.model)
    for _ in range(MAX_GID_DRAWS):
        status, gid, epoch = await scripts.run(
            lua.register(
                keys,
                worker.worker_id,
                worker.url,
                worker.block_size,
                worker.dp_rank,
                ttl_ms,
                new_gid(),
                worker.adapters,
                "" if worker.tier == "GPU" else worker.tier,
                worker.tier_of or "",
                worker.role,
                worker.max_model_len,
                worker.engine_kind,
            )
        )
        if status == "ok":
            await client.sadd(schema.models, worker.model)
            return Registration(int(gid), int(epoch))
    raise GidDrawsExhaustedError(f"Redis refused {MAX_GID_DRAWS} random gids for worker {worker.worker_id!r}")


async def retire(scripts: Scripts, keys: ModelKeys, worker_id: str, mode: str, gid: int | str) -> list[object]:
    """clear.lua: ``keep`` (a fresh empty gid) or ``leave`` (the record goes); gid '' = any.
    Returns ``[status, new gid]``."""
    for _ in range(MAX_GID_DRAWS):
        reply = await scripts.run(lua.clear(keys, worker_id, gid, mode, new_gid() if mode == "keep" else None))
        if reply[0] != "taken":
            return list(reply)
    raise GidDrawsExhaustedError(f"Redis refused {MAX_GID_DRAWS} random gids for worker {worker_id!r}")


async def stage_generation(
    scripts: Scripts, keys: ModelKeys, worker_id: str, gid: int, stage_ttl_ms: int
) -> int | None:
    """stage.lua: a fresh gid staged for a re-assert of the worker whose current gid is ``gid``;
    None when that registration is gone (Redis lost data) or was taken over."""
    for _ in range(MAX_GID_DRAWS):
        staged = new_gid()
        status = await scripts.run(lua.stage(keys, worker_id, gid, staged, stage_ttl_ms))
        if status == "ok":
            return staged
        if status != "taken":
            return None
    raise GidDrawsExhaustedError(f"Redis refused {MAX_GID_DRAWS} random gids for worker {worker_id!r}")


async def swap_generation(
    scripts: Scripts, keys: ModelKeys, worker_id: str, gid: int, staged: int, ttl_ms: int, blocks: int
) -> Registration | None:
    """swap.lua: the staged gid (holding ``blocks``) becomes current and ``gid`` is retired, in
    one step; None when the registration or the stage is gone."""
    status, epoch = await scripts.run(lua.swap(keys, worker_id, gid, staged, ttl_ms, blocks))
    return Registration(staged, int(epoch)) if status == "ok" else None
