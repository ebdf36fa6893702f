"""The router's predicted cached tokens against a REAL vLLM's reported ones (`pytest -m vllm`).

A real vLLM CPU server (tiny model, `--enable-prompt-tokens-details`), its agent, and a router
that tokenizes with the model's own tokenizer and chat template: for text, token-id and chat
prompts sharing prefixes, `x-kvroute-cached-tokens` must equal vLLM's
`usage.prompt_tokens_details.cached_tokens`, request by request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import aiohttp
import pytest

from kvindex.settings import RedisSettings
from kvroute.embedded_redis import RedisServer
from router.main import RunningRouter, running_router
from router.settings import RouterSettings
from tests.conftest import server_kinds
from tests.support import AgentProcess, wait_until
from tests.vllm_support import MODEL, TINY_MODEL, VllmServer, vllm_server

pytestmark = pytest.mark.vllm

SYSTEM = "You are a careful assistant for the cache block router project. " * 4


@pytest.fixture(scope="module")
def vllm() -> Iterator[VllmServer]:
    with vllm_server(num_blocks=64) as server:
        yield server


@pytest.fixture
async def router(vllm: VllmServer, redis_servers: dict[str, RedisServer]) -> AsyncIterator[RunningRouter]:
    redis = redis_servers[server_kinds()[0]]
    agent = AgentProcess(["--engine-url", f"{vllm.url}/v1", "--events", f"tcp://127.0.0.1:{vllm.events_port}",
                          "--replay", f"tcp://127.0.0.1:{vllm.replay_port}", "--topic", "kv",
                          "--redis-url", redis.url, "--prefix", "vllmrouter"]).start()  # fmt: skip
    settings = RouterSettings(redis=RedisSettings(url=redis.url, prefix="vllmrouter"), port=0,
                              tokenizers=((MODEL, TINY_MODEL),))  # fmt: skip
    try:
        async with running_router(settings) as running:

            async def ready() -> bool:
                await running.state.fleet.refresh()
                return bool(running.state.fleet.alive(MODEL))

            await wait_until(ready, 30)
            yield running
    finally:
        agent.kill()


def requests() -> list[tuple[str, dict]]:
    text = [{"prompt": SYSTEM + question} for question in ("What is a block?", "What is a cache?", "What is a block?")]
    ids = [{"prompt": [(i * 7) % 1900 + 10 for i in range(100)] + tail} for tail in ([1, 2], [3], [1, 2])]
    chat = [{"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]}
            for q in ("Hello there", "Tell me more", "Hello there")]  # fmt: skip
    return ([("/v1/completions", b) for b in text + ids]
            + [("/v1/chat/completions", b) for b in chat])  # fmt: skip


async def test_predicted_cached_tokens_equal_vllms(router):
    outcomes = []
    async with aiohttp.ClientSession() as session:
        for path, body in requests():
            async with session.post(router.url + path, json={"model": MODEL, "max_tokens": 2, **body}) as response:
                assert response.status == 200, await response.text()
                predicted = int(response.headers["x-kvroute-cached-tokens"])
                reported = (await response.json())["usage"]["prompt_tokens_details"]["cached_tokens"]
            outcomes.append((path, predicted, reported))
            await asyncio.sleep(0.3)  # vLLM's events reach the index before the next request
    assert all(predicted == reported for _, predicted, reported in outcomes), outcomes
    assert sum(1 for _, _, reported in outcomes if reported > 0) >= 6, outcomes  # shared prefixes did hit
