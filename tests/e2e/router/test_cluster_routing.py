"""Routing on a real Redis Cluster: simulated engines, agent processes and routers all on
``--redis-url redis+cluster://...`` (the session's cluster, a model name of the test's own).
Prompts are primed straight into one engine each, so that only the index can tell the router
where they are; their chains are chosen to land in buckets on every master."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator

import aiohttp
import pytest

from kvindex.redis_index import RedisIndex
from kvindex.settings import RedisSettings
from kvroute.devstack.embedded_cluster import LocalCluster
from router.main import RunningRouter
from tests.support import ROOT, SimFleet, wait_for_workers, wait_until
from tests.support.cluster import (
    BLOCK,
    PROMPT_BLOCKS,
    bucket_slot,
    chain_of,
    index_credits,
    prime,
    prompts_on_every_master,
    routed_to,
    segment_keys_per_master,
    start_router_process,
    wait_held,
)
from tests.support.router import start_router


@pytest.fixture
async def cluster_fleet(redis_cluster: LocalCluster, unique_name: str) -> AsyncIterator[SimFleet]:
    fleet = await SimFleet(redis_cluster.url, model=unique_name).start()
    yield fleet
    await fleet.stop()


@pytest.fixture
async def cluster_router(cluster_fleet: SimFleet, redis_cluster: LocalCluster) -> AsyncIterator[RunningRouter]:
    context, running = await start_router(redis_cluster.url)
    await wait_for_workers(running, cluster_fleet.count, cluster_fleet.model)
    yield running
    await context.__aexit__(None, None, None)  # type: ignore[attr-defined]


@pytest.fixture
async def cluster_index(redis_cluster: LocalCluster) -> AsyncIterator[RedisIndex]:
    client = RedisSettings(url=redis_cluster.url).client()
    yield RedisIndex(client)
    await client.aclose()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as opened:
        yield opened


async def primed_prompts(
    cluster: LocalCluster, fleet: SimFleet, index: RedisIndex, session: aiohttp.ClientSession
) -> list[tuple[list[int], str]]:
    """Two system prompts per master, prompt k primed into engine k modulo the fleet, each waited
    for in the index: (prompt, the worker holding it)."""
    held = []
    for k, prompt in enumerate(prompts_on_every_master(cluster, fleet.model)):
        worker = fleet.worker_id(k % fleet.count)
        await prime(session, fleet.engine_of(worker).url, fleet.model, prompt)
        await wait_held(index, fleet.model, prompt, worker)
        held.append((prompt, worker))
    return held


async def test_routing_follows_the_cache_across_shards(
    redis_cluster, cluster_fleet, cluster_router, cluster_index, session
):
    model = cluster_fleet.model
    held = await primed_prompts(redis_cluster, cluster_fleet, cluster_index, session)
    for n, (prompt, worker) in enumerate(held):
        assert await index_credits(session, cluster_router.url, model, prompt) == {
            **dict.fromkeys((cluster_fleet.worker_id(i) for i in range(cluster_fleet.count)), 0),
            worker: PROMPT_BLOCKS,
        }
        assert await routed_to(session, cluster_router.url, model, [*prompt, 77, n]) == worker
    # The index's segment keys lie on every master, each prompt's on the master of its bucket.
    per_master = segment_keys_per_master(redis_cluster, model)
    assert all(count > 0 for count in per_master.values()), per_master
    for prompt, _ in held:
        master = redis_cluster.master_for_slot(bucket_slot(model, prompt))
        assert per_master[master] >= 1
    assert cluster_router.state.decider.degraded_count == 0


async def test_a_repeated_prompt_goes_back_to_its_worker(
    redis_cluster, cluster_fleet, cluster_router, cluster_index, session
):
    model = cluster_fleet.model
    for n, prompt in enumerate(prompts_on_every_master(redis_cluster, model, per_master=1, seed=21)):
        first = await routed_to(session, cluster_router.url, model, [*prompt, n])
        await wait_held(cluster_index, model, prompt, first)  # the agent indexed what the engine cached
        for again in range(3):
            assert await routed_to(session, cluster_router.url, model, [*prompt, 100 + again, n]) == first
    assert cluster_router.state.decider.degraded_count == 0


def replica_read_calls(cluster: LocalCluster) -> int:
    """Read-only script calls (the router's match and liveness reads) the replicas have served."""
    total = 0
    for port in cluster.replica_ports():
        stats = cluster.client(port).info("commandstats")
        total += sum(int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in ("evalsha_ro", "eval_ro"))
    return total


async def test_a_router_reading_from_replicas_routes_by_the_cache(redis_cluster, cluster_fleet, cluster_index, session):
    model = cluster_fleet.model
    held = await primed_prompts(redis_cluster, cluster_fleet, cluster_index, session)
    before = replica_read_calls(redis_cluster)
    process, url = await start_router_process(redis_cluster.url, "--read-from-replicas")
    try:
        for n, (prompt, worker) in enumerate(held):

            async def credited(prompt=prompt, worker=worker) -> bool:  # the replicas have caught up
                return (await index_credits(session, url, model, prompt)).get(worker) == PROMPT_BLOCKS

            await wait_until(credited, 15)
            assert await routed_to(session, url, model, [*prompt, 88, n]) == worker
    finally:
        process.terminate()
        assert process.wait(15) == 0
    assert replica_read_calls(redis_cluster) > before  # the reads did go to the replicas


async def test_index_matches_on_a_cluster_client_see_every_block(
    redis_cluster, cluster_fleet, cluster_router, cluster_index, session
):
    model = cluster_fleet.model
    held = await primed_prompts(redis_cluster, cluster_fleet, cluster_index, session)
    for prompt, worker in held:
        chain = chain_of(prompt)
        owners = await cluster_index.owners_of_chain(model, chain)
        assert owners == [{worker: 1}] * len(chain)
        half = chain_of([*prompt[: 3 * BLOCK], 9999] + [1] * BLOCK)  # a prompt sharing 3 blocks
        assert (await cluster_index.match(model, half)).get(worker) == 3


def index_cli(*args: str) -> dict:
    """``kvroute index ... --json`` as a person would run it; its JSON."""
    done = subprocess.run(
        [sys.executable, "-m", "kvroute", "index", *args, "--json"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize("replicas", [[], ["--read-from-replicas"]])
async def test_kvroute_index_lookup_and_stats_on_the_cluster(
    redis_cluster, cluster_fleet, cluster_index, session, replicas
):
    model = cluster_fleet.model
    held = await primed_prompts(redis_cluster, cluster_fleet, cluster_index, session)
    for prompt, worker in held:
        tokens = ",".join(map(str, prompt))

        async def looked_up(tokens=tokens, worker=worker) -> bool:  # a replica may lag its master
            found = await asyncio.to_thread(
                index_cli, "lookup", "--redis-url", redis_cluster.url, *replicas, "--model", model, "--tokens", tokens
            )
            return {"id": worker, "matched_blocks": PROMPT_BLOCKS} in found["workers"] and all(
                block["owners"] == [worker] for block in found["blocks"]
            )

        await wait_until(looked_up, 15)
    stats = index_cli("stats", "--redis-url", redis_cluster.url, *replicas, "--model", model)
    (mine,) = stats["models"]
    assert mine["alive_workers"] == cluster_fleet.count
    assert mine["entries"] >= len(held) * PROMPT_BLOCKS
    assert stats["redis"]["keys"] >= sum(segment_keys_per_master(redis_cluster, model).values())
