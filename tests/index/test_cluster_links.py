"""Script batches on a Redis Cluster over one pipelined connection per node (kvindex.cluster_links):
the same replies as redis-py's cluster pipeline, the slot map followed after a slot moves, replica
reads on replicas, and waits that may be cancelled."""

from __future__ import annotations

import asyncio

import pytest
from redis.crc import key_slot

from kvindex import calls as lua
from kvindex.keys import KeySchema
from kvindex.scripts import Scripts
from kvindex.settings import RedisSettings
from kvroute.devstack.embedded_cluster import LocalCluster
from tests.support import raw_call


def tags_on_every_master(cluster: LocalCluster, name: str) -> list[str]:
    """A hash tag whose slot each master serves, one per master."""
    found: dict[int, str] = {}
    n = 0
    while len(found) < len(cluster.master_ports()):
        tag = f"{{{name}-{n}}}"
        found.setdefault(cluster.master_for_slot(key_slot(tag.encode())), tag)
        n += 1
    return list(found.values())


def node_id(cluster: LocalCluster, port: int) -> str:
    return str(cluster.client(port).execute_command("CLUSTER", "MYID"))


async def test_a_batch_over_every_shard_answers_as_the_cluster_pipeline_does(
    redis_cluster: LocalCluster, unique_name: str
) -> None:
    client = RedisSettings(url=redis_cluster.url).client()
    scripts = Scripts(client)
    try:
        await client.initialize()
        tags = tags_on_every_master(redis_cluster, unique_name)
        for n, tag in enumerate(tags):
            await client.zadd(f"{tag}:alive", {str(n): 10**15})
        batch = [raw_call("alive", [f"{tag}:alive"]) for tag in tags for _ in range(2)]
        links = await scripts.call_many(batch)
        assert scripts._links is not None and len(scripts._links._links) == len(tags)  # one link per master
        pipe = client.pipeline(transaction=False)
        for call in batch:
            pipe.execute_command("EVALSHA_RO", scripts._scripts["alive"].sha, 1, *call.keys)
        assert [r[1:] for r in links] == [r[1:] for r in await pipe.execute()]  # (r[0]: the server's clock)
        assert [reply[1:] for reply in links] == [[str(n).encode()] for n in range(len(tags)) for _ in range(2)]
        # A plain command in the batch goes to its key's shard too.
        version = lua.alive_version(KeySchema().for_model(unique_name))
        await client.set(version.keys[0], "v7")
        assert (await scripts.call_many([version, batch[0]]))[0] == b"v7"
    finally:
        await scripts.aclose()
        await client.aclose()


async def test_a_moved_slot_is_followed_and_the_next_batch_goes_to_its_new_master(unique_name: str) -> None:
    with LocalCluster(replicas_per_master=0) as cluster:
        client = RedisSettings(url=cluster.url).client()
        scripts = Scripts(client)
        try:
            await client.initialize()
            tag = f"{{{unique_name}}}"
            slot = key_slot(tag.encode())
            old = cluster.master_for_slot(slot)
            new = next(port for port in cluster.master_ports() if port != old)
            call = raw_call("alive", [f"{tag}:alive"])
            assert (await scripts.call_many([call]))[0][1:] == [b""]  # the old master's link is open
            # The slot (empty) moves to another master; the client's map still says the old one.
            for port in cluster.master_ports():
                cluster.client(port).execute_command("CLUSTER", "SETSLOT", slot, "NODE", node_id(cluster, new))
            cluster.client(new).zadd(f"{tag}:alive", {"1": 10**15})
            assert cluster.master_for_slot(slot) == new
            errors_before = cluster.client(old).info("stats")["total_error_replies"]
            replies = await scripts.call_many([call])  # MOVED from the old master, then sent again
            assert replies[0][1:] == [b"1"]
            moved = cluster.client(old).info("stats")["total_error_replies"]
            assert moved > errors_before  # (the link's, and the cluster client's own before it learnt)
            assert client.nodes_manager.get_node_from_slot(slot).port == new
            again = await scripts.call_many([call, call])
            assert [r[1:] for r in again] == [[b"1"], [b"1"]]
            assert cluster.client(old).info("stats")["total_error_replies"] == moved  # no MOVED any more
        finally:
            await scripts.aclose()
            await client.aclose()


async def test_read_only_calls_go_to_a_replica_when_the_client_reads_replicas(
    redis_cluster: LocalCluster, unique_name: str
) -> None:
    client = RedisSettings(url=redis_cluster.url, read_from_replicas=True).client()
    scripts = Scripts(client)
    tag = f"{{{unique_name}}}"
    master = redis_cluster.master_for_slot(key_slot(tag.encode()))
    replica = redis_cluster.replica_of(master)
    try:
        await client.initialize()
        await client.zadd(f"{tag}:alive", {"3": 10**15})
        redis_cluster.client(master).execute_command("WAIT", 1, 5000)
        before = redis_cluster.client(replica).info("commandstats").get("cmdstat_evalsha_ro", {}).get("calls", 0)
        replies = await scripts.call_many([raw_call("alive", [f"{tag}:alive"])] * 3)
        assert [r[1:] for r in replies] == [[b"3"]] * 3
        after = redis_cluster.client(replica).info("commandstats").get("cmdstat_evalsha_ro", {}).get("calls", 0)
        assert after - before >= 3  # served by the replica (READONLY on the link's connection)
    finally:
        await scripts.aclose()
        await client.aclose()


async def test_a_cancelled_wait_leaves_the_links_in_use(redis_cluster: LocalCluster, unique_name: str) -> None:
    client = RedisSettings(url=redis_cluster.url).client()
    scripts = Scripts(client)
    tag = f"{{{unique_name}}}"
    shard = redis_cluster.client(redis_cluster.master_for_slot(key_slot(tag.encode())))
    try:
        await client.initialize()
        await client.zadd(f"{tag}:alive", {"5": 10**15})
        call = raw_call("alive", [f"{tag}:alive"])
        await scripts.call_many([call])  # the link is open
        shard.execute_command("CLIENT", "PAUSE", 300, "ALL")
        waiting = asyncio.ensure_future(scripts.call_many([call]))
        await asyncio.sleep(0)  # written, not answered
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert [r[1:] for r in await scripts.call_many([call, call])] == [[b"5"], [b"5"]]
    finally:
        await scripts.aclose()
        await client.aclose()
