"""The simulated engine as a hybrid model (``--sliding-window 64``: a sliding-window KV-cache group
beside the full-attention one, sim_engine/hybrid.py), through its agent and a router: the
router's predicted cached tokens equal the engine's reported ones on every request, as
tests/e2e/test_vllm_hybrid.py checks against a real vLLM with the same model shape, cache and
requests (shared prefixes that fork, a growing conversation, evictions in a 40-block cache)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from kvindex.settings import RedisSettings
from kvroute.devstack.embedded_redis import RedisServer
from router.main import RunningRouter, running_router
from router.settings import RouterSettings
from sim_engine.settings import TINY_MODEL_DIR
from tests.conftest import server_kinds
from tests.support import SimFleet, wait_for_workers
from tests.support.hybrid import hybrid_outcome, hybrid_prompts

MODEL, BS, WINDOW = "tiny", 32, 64


@pytest.fixture
async def fleet(redis_servers: dict[str, RedisServer], unique_name: str) -> AsyncIterator[SimFleet]:
    url = redis_servers[server_kinds()[0]].url
    fleet = SimFleet(
        url,
        count=1,
        block_size=BS,
        num_blocks=40,
        max_model_len=400,
        sliding_window=WINDOW,
        agent_args=["--prefix", unique_name],
    )
    await fleet.start()
    yield fleet
    await fleet.stop()


@pytest.fixture
async def router(fleet: SimFleet, unique_name: str) -> AsyncIterator[RunningRouter]:
    redis = RedisSettings(url=fleet.redis_url, prefix=unique_name)
    settings = RouterSettings(redis=redis, port=0, tokenizers=((MODEL, TINY_MODEL_DIR),))
    async with running_router(settings) as running:
        await wait_for_workers(running, 1, fleet=fleet)
        yield running


async def test_predicted_cached_tokens_equal_the_simulated_hybrid_engines(router: RunningRouter, fleet: SimFleet):
    engine = fleet.engines[0].engine
    outcomes = []
    async with aiohttp.ClientSession() as session:
        for prompt in hybrid_prompts():
            oracle = engine.cached_prefix_tokens(prompt)  # the engine's own view (/debug/match)
            # and what the full-attention group alone would say: more than the engine finds on some requests
            predicted, reported, full_only = await hybrid_outcome(session, router, prompt, MODEL, BS)
            outcomes.append((len(prompt), predicted, reported, oracle, full_only))
    assert all(predicted == reported == oracle for _, predicted, reported, oracle, _ in outcomes), outcomes
    assert sum(reported > 0 for _, _, reported, _, _ in outcomes) >= 10, outcomes
    assert any(full_only > reported for _, _, reported, _, full_only in outcomes), outcomes  # the window's say
    metrics = await fleet.agents[0].metrics()
    assert metrics["kvroute_agent_window_blocks_removed_total"] > 0  # evictions in the window group too
    assert metrics["kvroute_agent_orphan_runs_total"] == 0
