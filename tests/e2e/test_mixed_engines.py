"""A fleet of vLLM, SGLang and TensorRT-LLM engines of one model (simulated engines speaking each
one's KV events and metrics: kvevents/sglang.py, kvevents/trtllm.py), each with an agent that
tells its engine's kind from its /v1/models (TensorRT-LLM's is named: its events are polled over
HTTP): the router routes by prefix on every kind, and predicts the cached tokens each engine
reports. An SGLang engine with 1-token pages (its default) is indexed in the index's 16-token
blocks, and so is a TensorRT-LLM engine with 32-token blocks: the router predicts the whole index
blocks of what they report."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from kvindex.hashing import sequence_hashes
from kvindex.settings import RedisSettings
from kvroute.devstack.embedded_redis import RedisServer
from router.main import RunningRouter, running_router
from router.settings import RouterSettings
from sim_engine.settings import TINY_MODEL_DIR
from tests.conftest import server_kinds
from tests.support import SimFleet, wait_for_workers, wait_until

MODEL, BS = "tiny", 16
KINDS = ("vllm", "sglang", "sglang", "trtllm")
PAGES = (16, 16, 1, 32)
FAMILIES = [[(f * 131 + i * 7) % 1800 + 10 for i in range(70)] for f in range(9)]


@pytest.fixture
async def fleet(redis_servers: dict[str, RedisServer], unique_name: str) -> AsyncIterator[SimFleet]:
    url = redis_servers[server_kinds()[0]].url
    fleet = SimFleet(
        url,
        count=len(KINDS),
        engine_kinds=KINDS,
        block_sizes=PAGES,
        num_blocks=4096,
        agent_args=["--prefix", unique_name],
    )
    await fleet.start()
    yield fleet
    await fleet.stop()


@pytest.fixture
async def router(fleet: SimFleet, unique_name: str) -> AsyncIterator[RunningRouter]:
    redis = RedisSettings(url=fleet.redis_url, prefix=unique_name)
    settings = RouterSettings(redis=redis, port=0, tokenizers=((MODEL, TINY_MODEL_DIR),), redis_timeout_s=2.0)
    async with running_router(settings) as running:
        await wait_for_workers(running, len(KINDS), fleet=fleet)
        yield running


async def send(session: aiohttp.ClientSession, router: RunningRouter, prompt: list[int]) -> tuple[str, int, int]:
    """(the worker, predicted and reported cached tokens) of one request through the router."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
    async with session.post(router.url + "/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        reply = await response.json()
        headers = response.headers
    return (
        headers["x-kvroute-worker"],
        int(headers["x-kvroute-cached-tokens"]),
        reply["usage"]["prompt_tokens_details"]["cached_tokens"],
    )


async def test_vllm_sglang_and_tensorrt_llm_workers_are_routed_by_prefix_and_predicted_exactly(
    router: RunningRouter, fleet: SimFleet
):
    kinds = {fleet.worker_id(number): kind for number, kind in enumerate(KINDS)}
    pages = {fleet.worker_id(number): page for number, page in enumerate(PAGES)}
    records = {record.worker_id: record for record in await router.state.index.workers(MODEL)}
    assert {records[worker].block_size for worker in kinds} == {BS}  # one index block size for the model
    assert {worker: records[worker].engine_kind for worker in kinds} == kinds  # what kvroute index workers says
    outcomes = []
    async with aiohttp.ClientSession() as session:
        for number, family in enumerate(FAMILIES):
            first = fleet.worker_id(number % len(KINDS))  # each kind of engine holds some prefixes
            body = {"model": MODEL, "prompt": family[:50], "max_tokens": 2}
            async with session.post(fleet.engines[number % len(KINDS)].url + "/v1/completions", json=body) as reply:
                assert reply.status == 200, await reply.text()
            page = PAGES[number % len(KINDS)]
            held = (50 - 1) // page * page // BS * BS  # the engine's whole pages, in whole index blocks
            try:
                await wait_until(
                    lambda first=first, held=held, family=family: holds(router, first, family[:50], held), 10
                )
            except AssertionError as exc:
                raise AssertionError(f"{exc}: {first} never held family {number}\n{fleet.agents_report(8)}") from None
            worker, predicted, reported = await send(session, router, family[:50] + [number + 1] * 20)
            outcomes.append((kinds[worker], pages[worker], worker == first, predicted, reported))
    assert all(same for _, _, same, _, _ in outcomes), outcomes  # each follow-up went to its prefix's holder
    for _, page, _, predicted, reported in outcomes:
        assert predicted == reported // BS * BS, outcomes  # whole blocks of what the engine reports
        assert predicted >= 32 and (page == BS) <= (predicted == reported), outcomes
    for agent, kind in zip(fleet.agents, KINDS, strict=True):
        _, health = await agent.health()
        assert (health["engine_kind"], health["block_size"], health["unreproducible_blocks"]) == (kind, BS, {})
        metrics = await agent.metrics()
        assert metrics["kvroute_agent_decode_errors_total"] == 0 and metrics["kvroute_agent_orphan_runs_total"] == 0
        assert metrics["kvroute_agent_blocks_stored_total"] > 0, kind


async def holds(router: RunningRouter, worker: str, prompt: list[int], tokens: int) -> bool:
    """Whether the index says ``worker`` holds ``tokens`` of ``prompt``."""
    matches = (await router.state.index.lookup(MODEL, sequence_hashes(prompt, BS))).matches
    return matches.get(worker, 0) * BS >= tokens
