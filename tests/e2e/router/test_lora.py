"""LoRA adapters through a router: simulated engines that serve different adapters (as vLLM's
--lora-modules), their agents, a router. A request naming an adapter is routed only among the
workers that serve it, hashed with the adapter's name, and its cached prefix is predicted exactly."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from router.main import RunningRouter
from tests.support import SimFleet, wait_for_workers, wait_until
from tests.support.cluster import index_credits
from tests.support.router import PREFIX, complete, start_router

ADAPTERS = [["sql-lora"], ["sql-lora", "chat-lora"], []]


@pytest.fixture
async def lora_fleet(redis_server) -> AsyncIterator[SimFleet]:
    fleet = await SimFleet(redis_server.url, adapters=ADAPTERS).start()
    yield fleet
    await fleet.stop()


@pytest.fixture
async def router(lora_fleet: SimFleet, redis_server) -> AsyncIterator[RunningRouter]:
    context, running = await start_router(redis_server.url)
    await wait_for_workers(running, lora_fleet.count)

    async def adapters_seen() -> bool:
        await running.state.fleet.refresh()
        return running.state.fleet.adapters("tiny") == ["chat-lora", "sql-lora"]

    await wait_until(adapters_seen, 20)
    yield running
    await context.__aexit__(None, None, None)  # type: ignore[attr-defined]


async def wait_predicted_hit(router: RunningRouter, model: str, owner: str) -> None:
    """Until the index credits ``owner`` with the whole shared prefix for ``model`` (its agent
    indexed it). Asked with /debug/route, which routes nothing: a probe sent as a completion could
    land on another worker before the index knows the owner, and plant the prefix there too."""

    async def indexed() -> bool:
        async with aiohttp.ClientSession() as session:
            credits = await index_credits(session, router.url, model, [*PREFIX, 2])
        return credits.get(owner) == len(PREFIX) // 16

    await wait_until(indexed, 10)


async def test_an_adapters_requests_go_to_its_workers_and_their_cache_is_predicted(router, lora_fleet):
    serving = {"sql-lora": {lora_fleet.worker_id(0), lora_fleet.worker_id(1)}, "chat-lora": {lora_fleet.worker_id(1)}}
    for adapter, workers in serving.items():
        status, headers, body = await complete(router.url, [*PREFIX, 1], model=adapter)
        assert status == 200 and headers["x-kvroute-worker"] in workers, (adapter, headers)
        assert body["model"] == adapter
        owner = headers["x-kvroute-worker"]
        await wait_predicted_hit(router, adapter, owner)
        for tail in range(3, 6):
            status, headers, body = await complete(router.url, [*PREFIX, tail], model=adapter)
            assert status == 200 and headers["x-kvroute-worker"] == owner
            assert int(headers["x-kvroute-cached-tokens"]) == 160
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 160


async def test_the_base_model_and_each_adapter_are_separate_caches(router, lora_fleet):
    status, headers, _ = await complete(router.url, [*PREFIX, 1], model="sql-lora")
    owner = headers["x-kvroute-worker"]
    await wait_predicted_hit(router, "sql-lora", owner)
    # The same tokens as the base model or as another adapter share nothing with the owner's blocks.
    for model in ("tiny", "chat-lora"):
        status, headers, body = await complete(router.url, [*PREFIX, 9], model=model)
        assert status == 200
        if headers["x-kvroute-worker"] == owner:
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert int(headers["x-kvroute-cached-tokens"]) == 0


async def test_an_adapter_no_worker_serves_is_404_naming_what_is_served(router):
    status, _, body = await complete(router.url, [*PREFIX, 1], model="nope-lora")
    assert status == 404
    message = body["error"]["message"]
    assert "nope-lora" in message and "tiny (LoRA adapters: chat-lora, sql-lora)" in message
    async with aiohttp.ClientSession() as session, session.get(router.url + "/v1/models") as response:
        listed = {(m["id"], m.get("parent")) for m in (await response.json())["data"]}
    assert listed == {("tiny", None), ("sql-lora", "tiny"), ("chat-lora", "tiny")}
    async with aiohttp.ClientSession() as session, session.get(router.url + "/dashboard/api/fleet") as response:
        (model,) = (await response.json())["models"]
    assert sorted(tuple(w["adapters"]) for w in model["workers"]) == [(), ("chat-lora", "sql-lora"), ("sql-lora",)]
    assert {w["role"] for w in model["workers"]} == {"both"}  # agents told no role: complete engines


async def test_an_adapter_loaded_at_run_time_is_routed_to_once_its_agent_says_so(router, lora_fleet):
    engine = lora_fleet.engines[2]
    async with aiohttp.ClientSession() as session:
        body = {"lora_name": "new-lora", "lora_path": "/adapters/new"}
        async with session.post(engine.url + "/v1/load_lora_adapter", json=body) as response:
            assert response.status == 200

    async def routable() -> bool:
        status, headers, _ = await complete(router.url, [*PREFIX, 1], model="new-lora")
        return status == 200 and headers["x-kvroute-worker"] == lora_fleet.worker_id(2)

    await wait_until(routable, 15)
