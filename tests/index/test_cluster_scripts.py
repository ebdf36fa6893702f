"""Script batches on a Redis Cluster whose shards do not know the scripts yet (a fresh cluster, a
promoted replica, SCRIPT FLUSH): the calls are sent again with their source as one more pipeline
per shard, so a burst of batches never needs more connections for the retry than for the batch."""

from __future__ import annotations

import asyncio

from redis.crc import key_slot

from kvindex.scripts import Scripts
from kvindex.settings import RedisSettings
from kvroute.devstack.embedded_cluster import LocalCluster
from tests.support import raw_call

BATCHES = 6
CALLS_PER_BATCH = 3  # a decision's alive, load and expected reads: all on the model's shard


async def test_a_burst_that_meets_shards_without_the_scripts_needs_no_more_connections(
    redis_cluster: LocalCluster, unique_name: str
) -> None:
    # A pool of 8 per node (4 doubled, as the router's settings do): room for the six batches'
    # pipelines, not for their 18 calls sent again one by one.
    client = RedisSettings(url=redis_cluster.url).client(command_timeouts=False, max_connections=4)
    scripts = Scripts(client)
    tag = f"{{{unique_name}}}"
    shard = redis_cluster.client(redis_cluster.master_for_slot(key_slot(tag.encode())))
    try:
        await client.initialize()  # the slot map read before the shard is paused
        for port in redis_cluster.master_ports():
            redis_cluster.client(port).script_flush()
        # Held until every batch is on the wire, so that their replies (NOSCRIPT) come together.
        shard.execute_command("CLIENT", "PAUSE", 300, "ALL")
        batch = [raw_call("alive", [f"{tag}:alive:{n}"]) for n in range(CALLS_PER_BATCH)]
        replies = await asyncio.gather(*(scripts.call_many(batch) for _ in range(BATCHES)))
        assert not any(isinstance(r, Exception) for rs in replies for r in rs), replies
        assert [[alive[1:] for alive in rs] for rs in replies] == [[[b""]] * CALLS_PER_BATCH] * BATCHES
    finally:
        await client.aclose()
