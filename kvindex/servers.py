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
    """The run_id of the server; on a cluster, the ids of the nodes that are masters now (from
    CLUSTER NODES: a promoted replica changes them, even while this client's slot map still
    names the old master) and each master's run_id (a master restarted in place changes it).
    None when INFO lacks a run_id."""
    infos = await _per_master(client, "server")
    ids = [f"{name}:{info['run_id']}" for name, info in sorted(infos.items()) if info.get("run_id")]
    if len(ids) != len(infos):
        return None
    if not is_cluster(client):
        return ids[0].split(":", 1)[1]
    nodes = await client.cluster_nodes()  # type: ignore[union-attr]
    masters = sorted(
        str(node["node_id"]) for node in nodes.values() if {"master"} & _flags(node) and not {"fail"} & _flags(node)
    )
    return ",".join(masters + ids)


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


def _flags(node: Any) -> set[str]:
    return set(str(node.get("flags", "")).split(","))
