"""The router's predicted cached tokens against a REAL vLLM's reported ones (`pytest -m vllm`).

A real vLLM CPU server (tiny model, `--enable-prompt-tokens-details`), its agent, and a router
that tokenizes with the model's own tokenizer and chat template: for text, token-id and chat
prompts sharing prefixes, `x-kvroute-cached-tokens` must equal vLLM's
`usage.prompt_tokens_details.cached_tokens`, request by request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import aiohttp
import pytest

from kvindex.hashing import sequence_hashes
from kvroute.devstack.embedded_redis import RedisServer
from router.main import RunningRouter
from tests.conftest import server_kinds
from tests.support import wait_until
from tests.support.vllm import BS, MODEL, VllmServer, agent_and_router, sees_the_worker, vllm_server

pytestmark = pytest.mark.vllm

SYSTEM = "You are a careful assistant for the cache block router project. " * 4


@pytest.fixture(scope="module")
def vllm() -> Iterator[VllmServer]:
    with vllm_server(num_blocks=64) as server:
        yield server


@pytest.fixture
async def router(vllm: VllmServer, redis_servers: dict[str, RedisServer]) -> AsyncIterator[RunningRouter]:
    async with agent_and_router(vllm, redis_servers[server_kinds()[0]].url, "vllmrouter", sees_the_worker) as running:
        yield running


def requests() -> list[tuple[str, dict]]:
    text = [{"prompt": SYSTEM + question} for question in ("What is a block?", "What is a cache?", "What is a block?")]
    ids = [{"prompt": [(i * 7) % 1900 + 10 for i in range(100)] + tail} for tail in ([1, 2], [3], [1, 2])]
    chat = [
        {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]}
        for q in ("Hello there", "Tell me more", "Hello there")
    ]
    return [("/v1/completions", b) for b in text + ids] + [("/v1/chat/completions", b) for b in chat]


def prompt_token_ids(reply: dict) -> list[int]:
    """vLLM's prompt token ids (``return_token_ids``): on the choice, or top level for chat."""
    return reply.get("prompt_token_ids") or reply["choices"][0]["prompt_token_ids"]


async def wait_indexed(router: RunningRouter, prompt: list[int]) -> None:
    """Until the index holds every full block of ``prompt`` (vLLM cached them all: its events
    went through the agent)."""
    chain = sequence_hashes(prompt, BS)

    async def indexed() -> bool:
        matched = (await router.state.index.lookup(MODEL, chain)).matches
        return max(matched.values(), default=0) >= len(chain)

    await wait_until(indexed, 30)


async def test_predicted_cached_tokens_equal_vllms(router):
    outcomes = []
    async with aiohttp.ClientSession() as session:
        for path, body in requests():
            body = {"model": MODEL, "max_tokens": 2, "return_token_ids": True, **body}
            async with session.post(router.url + path, json=body) as response:
                assert response.status == 200, await response.text()
                predicted = int(response.headers["x-kvroute-cached-tokens"])
                reply = await response.json()
            outcomes.append((path, predicted, reply["usage"]["prompt_tokens_details"]["cached_tokens"]))
            await wait_indexed(router, prompt_token_ids(reply))  # before the next request is routed
    assert all(predicted == reported for _, predicted, reported in outcomes), outcomes
    assert sum(1 for _, _, reported in outcomes if reported > 0) >= 6, outcomes  # shared prefixes did hit
