"""Facts about the Redis server(s) behind a client: a single server or a cluster's masters."""

from __future__ import annotations

from typing import Any

from kvindex.cluster import RedisClient, is_cluster


async def _per_master(client: RedisClient, section: str) -> dict[str, dict[str, Any]]:
    """INFO ``section`` of each master (one entry for a single server), by node name."""
    if is_cluster(client):
        replies = await client.info(section, target_nodes=client.PRIMARIES)  # type: ignore[call-arg, union-attr]
        return {str(name): info for name, info in replies.items()}
    return {"server": await client.info(section)}


async def server_run_id(client: RedisClient) -> str | None:
    """The run_id of the server, or of every master of a cluster joined (node:run_id, sorted):
    it changes when a server restarts or a replica is promoted. None when INFO lacks it."""
    infos = await _per_master(client, "server")
    ids = [f"{name}:{info['run_id']}" for name, info in sorted(infos.items()) if info.get("run_id")]
    if len(ids) != len(infos):
        return None
    return ids[0].split(":", 1)[1] if not is_cluster(client) else ",".join(ids)


async def server_memory(client: RedisClient) -> dict[str, int]:
    """Memory used and keys held, summed over a cluster's masters."""
    infos = await _per_master(client, "memory")
    used = sum(int(info["used_memory"]) for info in infos.values())
    if is_cluster(client):
        sizes = await client.dbsize(target_nodes=client.PRIMARIES)  # type: ignore[call-arg, union-attr]
        keys = sum(int(v) for v in sizes.values()) if isinstance(sizes, dict) else int(sizes)
    else:
        keys = int(await client.dbsize())
    return {"used_memory": used, "keys": keys}
