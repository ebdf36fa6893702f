"""Cache tiers through a router: simulated engines with a small GPU cache and a CPU tier behind it
(vLLM's CPU offloading), or a disk tier (LMCache's local-disk backend), their agents indexing
every tier, a router. A prefix evicted from a worker's GPU but held in its CPU or disk tier still
draws its prompts there, and the router predicts the cached tokens the engine reports (loaded ones
included)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from kvindex.hashing import sequence_hashes
from kvindex.tiers import tier_holder
from kvservice.metrics_page import read_metrics
from router.main import RunningRouter
from router.routing.scoring import ScoringWeights
from router.routing.tiers import TierCosts
from tests.support import SimFleet, wait_for_workers, wait_until
from tests.support.router import PREFIX, complete, start_router

BS = 16


@pytest.fixture
async def tier_fleet(redis_server) -> AsyncIterator[SimFleet]:
    fleet = await SimFleet(redis_server.url, count=2, num_blocks=24, cpu_blocks=400).start()
    yield fleet
    await fleet.stop()


@pytest.fixture
async def router(tier_fleet: SimFleet, redis_server) -> AsyncIterator[RunningRouter]:
    context, running = await start_router(redis_server.url)
    await wait_for_workers(running, tier_fleet.count)
    yield running
    await context.__aexit__(None, None, None)  # type: ignore[attr-defined]


async def serve_directly(url: str, prompt: list[int]) -> dict:
    async with aiohttp.ClientSession() as session:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
        async with session.post(url + "/v1/completions", json=body) as response:
            assert response.status == 200
            return await response.json()


async def routed_there_and_predicted(router: RunningRouter, worker: str, prefix: list[int]) -> None:
    """A prompt of ``prefix`` goes to ``worker``, and the cached tokens predicted (the prefix,
    loaded from a lower tier) are the engine's report."""
    status, headers, body = await complete(router.url, [*prefix, 3])
    assert status == 200 and headers["x-kvroute-worker"] == worker
    reported = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert int(headers["x-kvroute-cached-tokens"]) == reported == len(prefix)


async def test_a_prefix_only_the_cpu_tier_holds_draws_its_prompt_and_is_predicted(router, tier_fleet):
    owner = tier_fleet.engines[0]
    worker = tier_fleet.worker_id(0)
    prefix = PREFIX[: 10 * BS]
    await serve_directly(owner.url, [*prefix, 1])
    for n in range(3):  # other prompts fill the owner's 23-block GPU cache: the prefix leaves it
        filler = [(i * 13 + n) % 1900 + 5 for i in range(10 * BS)]
        await serve_directly(owner.url, [*filler, 2])
    chain = sequence_hashes(prefix, BS)
    last = sequence_hashes(filler, BS)

    async def only_the_cpu_holds_it() -> bool:
        # settled: the last filler's stores are in, and so is every eviction before them (in order)
        settled = ((await router.state.index.lookup("tiny", last)).matches).get(worker, 0) == len(last)
        matched = (await router.state.index.lookup("tiny", chain)).matches
        cpu = matched.get(tier_holder(worker, "CPU"), 0) == len(chain)
        return settled and cpu and matched.get(worker, 0) < len(chain)

    await wait_until(only_the_cpu_holds_it, 15)
    await router.state.fleet.refresh()  # the router knows of the worker's CPU tier (within a second)
    await routed_there_and_predicted(router, worker, prefix)
    await router.state.fleet.refresh()  # the dashboard shows the last listing

    async def loads_counted() -> bool:  # counted after the reply went out (the client does not wait for it)
        async with aiohttp.ClientSession() as session:
            metrics = await read_metrics(session, router.url + "/metrics")
        return metrics.value("kvroute_router_loaded_prefix_tokens_total", tier="CPU") == len(prefix)

    await wait_until(loads_counted, 5)
    async with aiohttp.ClientSession() as session, session.get(router.url + "/dashboard/api/fleet") as response:
        (model,) = (await response.json())["models"]
    by_worker = {w["id"]: w["tier_blocks"] for w in model["workers"]}
    assert by_worker[worker]["CPU"] >= len(chain) and set(by_worker) == {worker, tier_fleet.worker_id(1)}


@pytest.fixture
async def disk_fleet(redis_server) -> AsyncIterator[SimFleet]:
    # no CPU tier: the disk is right behind the GPU
    fleet = await SimFleet(redis_server.url, count=2, num_blocks=24, disk_blocks=400).start()
    yield fleet
    await fleet.stop()


async def test_a_prefix_only_the_disk_tier_holds_draws_its_prompt_and_is_predicted(disk_fleet, redis_server):
    # the engines' disk load time (30 ms per 1k tokens) in the router's wall clock, as an operator sets it
    costs = TierCosts(load_ms_per_1k={"DISK": 30.0 / disk_fleet.speedup})
    context, router = await start_router(redis_server.url, weights=ScoringWeights(tiers=costs))
    try:
        await wait_for_workers(router, disk_fleet.count)
        owner, worker = disk_fleet.engines[0], disk_fleet.worker_id(0)
        prefix = PREFIX[: 10 * BS]
        await serve_directly(owner.url, [*prefix, 1])
        others = [[(i * 13 + n) % 1900 + 5 for i in range(10 * BS)] for n in range(3)]
        for other in others:  # they fill the owner's 23-block GPU cache: the prefix leaves it
            await serve_directly(owner.url, [*other, 2])
        chain, last = sequence_hashes(prefix, BS), sequence_hashes(others[-1], BS)
        gpu_blocks = []

        async def only_the_disk_holds_it() -> bool:
            # the last prompt's GPU blocks indexed: every change before them is too (the prefix's
            # blocks leaving the GPU; each batch's lower tiers are written before its GPU changes)
            settled = ((await router.state.index.lookup("tiny", last)).matches).get(worker, 0) == len(last)
            matched = (await router.state.index.lookup("tiny", chain)).matches
            gpu_blocks[:] = [matched.get(worker, 0)]
            held = matched.get(tier_holder(worker, "DISK"), 0) == len(chain)
            return settled and held and gpu_blocks[0] < len(chain) and not matched.get(tier_holder(worker, "CPU"))

        await wait_until(only_the_disk_holds_it, 15)
        await router.state.fleet.refresh()  # the router knows of the worker's disk tier (within a second)
        await routed_there_and_predicted(router, worker, prefix)

        async def loads_counted() -> bool:  # counted after the reply went out
            async with aiohttp.ClientSession() as session:
                metrics = await read_metrics(session, router.url + "/metrics")
            return metrics.value("kvroute_router_loaded_prefix_tokens_total", tier="DISK") == len(prefix)

        await wait_until(loads_counted, 5)
        async with aiohttp.ClientSession() as session:
            engine_metrics = await read_metrics(session, owner.url + "/metrics")
        # the engine loaded from its disk what its GPU no longer held
        loaded = engine_metrics.value("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
        assert loaded == len(prefix) - gpu_blocks[0] * BS > 0
    finally:
        await context.__aexit__(None, None, None)  # type: ignore[attr-defined]
