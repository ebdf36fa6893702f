"""A hybrid model against a REAL vLLM (`pytest -m vllm`): the tiny model with a sliding-window layer
(window 64) beside a full-attention one, so vLLM keeps two KV-cache groups and its sliding-window
group caches only the blocks a later hit can use. The agent indexes both groups, the router
computes each worker's hit as vLLM's hybrid cache manager does (kvindex/groups.py), and its
predicted cached tokens equal vLLM's reported ones on every request: shared prefixes that fork,
a growing conversation, and evictions in a 40-block cache."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import aiohttp
import pytest

from kvroute.devstack.embedded_redis import RedisServer
from router.main import RunningRouter
from tests.conftest import server_kinds
from tests.support.hybrid import hybrid_outcome, hybrid_prompts
from tests.support.vllm import (
    BS,
    MODEL,
    SLIDING_WINDOW_CONFIG,
    VllmServer,
    agent_and_router,
    sees_the_worker,
    vllm_server,
)

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def vllm() -> Iterator[VllmServer]:
    with vllm_server(num_blocks=40, max_model_len=400, config=SLIDING_WINDOW_CONFIG) as server:
        yield server


@pytest.fixture
async def router(vllm: VllmServer, redis_servers: dict[str, RedisServer]) -> AsyncIterator[RunningRouter]:
    async with agent_and_router(vllm, redis_servers[server_kinds()[0]].url, "vllmhybrid", sees_the_worker) as running:
        yield running


async def test_predicted_cached_tokens_equal_vllms_on_a_sliding_window_model(router, vllm):
    outcomes = []
    async with aiohttp.ClientSession() as session:
        for prompt in hybrid_prompts():
            # and what the full-attention group alone would say: more than vLLM finds on some requests
            predicted, reported, full_only = await hybrid_outcome(session, router, prompt, MODEL, BS)
            outcomes.append((len(prompt), predicted, reported, full_only))
    assert all(predicted == reported for _, predicted, reported, _ in outcomes), outcomes
    assert sum(reported > 0 for _, _, reported, _ in outcomes) >= 10, outcomes
    assert any(full_only > reported for _, _, reported, full_only in outcomes), outcomes
