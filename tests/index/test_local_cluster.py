"""The cluster harness itself: LocalCluster builds a real cluster of each server kind, and its
fault helpers (failover, kill_master, restart_node) leave a cluster that clients can use."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot
from redis.exceptions import MovedError

from kvroute.devstack.embedded_cluster import LocalCluster
from kvroute.devstack.embedded_redis import available_servers
from tests.conftest import server_kinds
from tests.support import wait_until


@pytest.fixture(scope="module", params=server_kinds())
def cluster(request: pytest.FixtureRequest) -> Iterator[LocalCluster]:
    """One cluster per server kind for this module; the fault tests leave it whole again."""
    with LocalCluster(binary=available_servers()[request.param]) as started:
        yield started


@pytest.fixture
async def client(cluster: LocalCluster) -> AsyncIterator[RedisCluster]:
    nodes = [ClusterNode(host, port) for host, port in cluster.startup_nodes]
    cluster_client = RedisCluster(startup_nodes=nodes, decode_responses=True)
    yield cluster_client
    await cluster_client.aclose()


def keys_on_every_master(cluster: LocalCluster, prefix: str) -> dict[int, str]:
    """One key per master, each with its own hash tag: master port -> key."""
    by_master: dict[int, str] = {}
    for n in range(1000):
        key = f"{{{prefix}-{n}}}:value"
        by_master.setdefault(cluster.master_for_slot(key_slot(key.encode())), key)
        if len(by_master) == len(cluster.master_ports()):
            return by_master
    raise AssertionError(f"no hash tags found for every master: {by_master}")


async def test_url_and_nodes_describe_the_cluster(cluster: LocalCluster, client: RedisCluster) -> None:
    ports = [port for _, port in cluster.startup_nodes]
    assert cluster.url == "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in ports)
    assert len(cluster.nodes) == 6 and set(ports) <= set(cluster.nodes)
    assert len(cluster.master_ports()) == 3 and len(cluster.replica_ports()) == 3
    replicas = {cluster.replica_of(master) for master in cluster.master_ports()}
    assert replicas == set(cluster.replica_ports())
    assert all(port < 55535 for port in cluster.nodes)
    assert await client.ping()


async def test_keys_with_different_hash_tags_land_on_different_masters(
    cluster: LocalCluster, client: RedisCluster, unique_name: str
) -> None:
    by_master = keys_on_every_master(cluster, unique_name)
    for master, key in by_master.items():
        await client.set(key, f"on {master}")
    for master, key in by_master.items():
        direct = Redis(port=master, decode_responses=True)
        assert await direct.get(key) == f"on {master}"  # the master itself holds it, no MOVED
        await direct.aclose()


async def test_writes_reach_the_replica(cluster: LocalCluster, client: RedisCluster, unique_name: str) -> None:
    key = f"{{{unique_name}}}:replicated"
    await client.set(key, "copied")
    replica = Redis(port=cluster.replica_of(cluster.master_for_slot(key_slot(key.encode()))), decode_responses=True)
    with pytest.raises(MovedError):  # a cluster replica sends plain reads to the master
        await replica.get(key)
    await replica.execute_command("READONLY")

    async def copied() -> bool:
        return await replica.get(key) == "copied"

    await wait_until(copied)
    await replica.aclose()


async def test_failover_keeps_data_and_the_client_follows(
    cluster: LocalCluster, client: RedisCluster, unique_name: str
) -> None:
    by_master = keys_on_every_master(cluster, unique_name)
    for key in by_master.values():
        await client.set(key, "before")
    old_master, key = next(iter(by_master.items()))
    slot = key_slot(key.encode())
    expected_new = cluster.replica_of(old_master)

    new_master = cluster.failover(old_master)  # a manual failover first lets the replica catch up

    assert new_master == expected_new == cluster.master_for_slot(slot)
    assert cluster.nodes[old_master] == "replica" and cluster.replica_of(new_master) == old_master
    for other in by_master.values():  # the client's slot map is stale: it follows MOVED
        assert await client.get(other) == "before"
    await client.set(key, "after")
    assert await client.get(key) == "after"


@pytest.mark.faults
async def test_killed_master_is_replaced_by_its_replica_with_acknowledged_writes(
    cluster: LocalCluster, client: RedisCluster, unique_name: str
) -> None:
    master, key = next(iter(keys_on_every_master(cluster, unique_name).items()))
    replica = cluster.replica_of(master)
    direct = cluster.client(master)  # WAIT counts the writes of its own connection
    direct.set(key, "acknowledged")
    assert direct.execute_command("WAIT", 1, 1000) == 1
    assert await client.get(key) == "acknowledged"  # the client has a connection to the master

    assert cluster.kill_master(master) == replica

    assert cluster.nodes[master] == "down" and cluster.master_for_slot(key_slot(key.encode())) == replica
    assert await client.get(key) == "acknowledged"
    with pytest.raises(ValueError, match="not a live master"):
        cluster.kill_master(master)

    cluster.restart_node(master)  # the module cluster is whole again for any test after this one

    assert cluster.nodes[master] == "replica" and cluster.replica_of(replica) == master
    assert await client.get(key) == "acknowledged"


def test_a_server_that_cannot_start_is_reported_with_its_output() -> None:
    with pytest.raises(RuntimeError, match=r"cluster node did not start: /bin/false: node \d+ \(exited 1\)"):
        LocalCluster(binary="/bin/false").start()


async def test_session_fixture_serves_a_cluster(redis_cluster: LocalCluster) -> None:
    nodes = [ClusterNode(host, port) for host, port in redis_cluster.startup_nodes]
    cluster_client = RedisCluster(startup_nodes=nodes, decode_responses=True)
    assert await cluster_client.ping()
    assert redis_cluster.url.startswith("redis+cluster://127.0.0.1:")
    await cluster_client.aclose()


@pytest.mark.faults
def test_kill_master_returns_whichever_replica_won_the_election() -> None:
    with LocalCluster(masters=3, replicas_per_master=2) as cluster:
        master = cluster.master_ports()[0]
        replicas = cluster.replicas_of(master)
        assert len(replicas) == 2

        promoted = cluster.kill_master(master)

        assert promoted in replicas and cluster.nodes[promoted] == "master"
        assert cluster.replicas_of(promoted) == [port for port in replicas if port != promoted]
