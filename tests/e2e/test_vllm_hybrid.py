"""A hybrid model against a REAL vLLM (`pytest -m vllm`): the tiny model with a sliding-window layer
(window 64) beside a full-attention one, so vLLM keeps two KV-cache groups and its sliding-window
group caches only the blocks a later hit can use. The agent indexes both groups, the router
computes each worker's hit as vLLM's hybrid cache manager does (kvindex/groups.py), and its
predicted cached tokens equal vLLM's reported ones on every request: shared prefixes that fork,
a growing conversation, and evictions in a 40-block cache."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Iterator

import aiohttp
import pytest

from kvindex.groups import is_hybrid
from kvindex.hashing import sequence_hashes
from kvroute.devstack.embedded_redis import RedisServer
from router.main import RunningRouter
from tests.conftest import server_kinds
from tests.support import wait_until
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


def prompts() -> list[list[int]]:
    rng = random.Random(11)
    base = [rng.randrange(5, 2000) for _ in range(300)]

    def tail(n: int) -> list[int]:
        return [rng.randrange(5, 2000) for _ in range(n)]

    forks = [base[:200] + tail(40), base[:200] + tail(60), base[:150] + tail(70), base[:300], base[:100] + tail(40)]
    out = [*forks]
    for _ in range(6):  # pressure: strangers, and the shared start cut at other places
        out += [tail(rng.randrange(60, 300)), base[: rng.choice([64, 100, 130, 200, 260, 300])] + tail(20)]
    conversation = base[:90]
    for _ in range(5):
        conversation = conversation + tail(rng.randrange(20, 50))
        out.append(conversation)
    return out + forks


async def wait_indexed(router: RunningRouter, prompt: list[int]) -> None:
    """Until the index holds the prompt's full blocks (vLLM cached them: its events, both groups'
    in one batch, went through the agent) and the router knows the model's groups."""
    chain = sequence_hashes(prompt, BS)

    async def indexed() -> bool:
        await router.state.fleet.refresh()
        matched = await router.state.index.match(MODEL, chain)
        return max(matched.values(), default=0) >= len(chain) and is_hybrid(router.state.fleet.kv_groups(MODEL))

    await wait_until(indexed, 30)


async def test_predicted_cached_tokens_equal_vllms_on_a_sliding_window_model(router, vllm):
    outcomes = []
    async with aiohttp.ClientSession() as session:
        for prompt in prompts():
            # what the full-attention group alone would say: more than vLLM finds on some requests
            full = await router.state.index.match(MODEL, sequence_hashes(prompt, BS))
            full_only = min(max(full.values(), default=0) * BS, (len(prompt) - 1) // BS * BS)
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
            async with session.post(router.url + "/v1/completions", json=body) as response:
                assert response.status == 200, await response.text()
                predicted = int(response.headers["x-kvroute-cached-tokens"])
                reply = await response.json()
            reported = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
            outcomes.append((len(prompt), predicted, reported, full_only))
            await wait_indexed(router, prompt)
    assert all(predicted == reported for _, predicted, reported, _ in outcomes), outcomes
    assert sum(reported > 0 for _, _, reported, _ in outcomes) >= 10, outcomes
    assert any(full_only > reported for _, _, reported, full_only in outcomes), outcomes
