"""LoRA adapters against a REAL vLLM (`pytest -m vllm`): two random adapters of the tiny model made
with peft, served with --lora-modules; the agent reads them from /v1/models and indexes their
blocks; the router's predicted cached tokens equal vLLM's reported ones on every request, for
the base model and each adapter, and an adapter's requests go to the worker that serves it."""

from __future__ import annotations

import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest

from kvindex.hashing import sequence_hashes
from kvroute.devstack.embedded_redis import RedisServer
from router.main import RunningRouter
from tests.conftest import server_kinds
from tests.support import wait_until
from tests.support.vllm import BS, MODEL, VllmServer, agent_and_router, make_lora_adapters, vllm_server

pytestmark = pytest.mark.vllm

ADAPTERS = ("sql-lora", "chat-lora")
SYSTEM = "You are a careful assistant for the cache block router project. " * 4


@pytest.fixture(scope="module")
def vllm() -> Iterator[VllmServer]:
    with tempfile.TemporaryDirectory(prefix="kvroute-lora-") as directory:
        adapters = make_lora_adapters(Path(directory), ADAPTERS)
        modules = [f"{name}={path}" for name, path in adapters.items()]
        lora = ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2", "--lora-modules", *modules]
        with vllm_server(num_blocks=64, extra_args=lora) as server:
            yield server


@pytest.fixture
async def router(vllm: VllmServer, redis_servers: dict[str, RedisServer]) -> AsyncIterator[RunningRouter]:
    async def adapters_seen(running: RunningRouter) -> bool:
        return running.state.fleet.adapters(MODEL) == sorted(ADAPTERS)

    async with agent_and_router(vllm, redis_servers[server_kinds()[0]].url, "vllmlora", adapters_seen) as running:
        yield running


async def wait_indexed(router: RunningRouter, prompt: list[int], adapter: str | None) -> None:
    """Until the index holds every full block of ``prompt`` under ``adapter`` (vLLM cached them
    and its events went through the agent)."""
    chain = sequence_hashes(prompt, BS, lora_name=adapter)

    async def indexed() -> bool:
        matched = (await router.state.index.lookup(MODEL, chain)).matches
        return max(matched.values(), default=0) >= len(chain)

    await wait_until(indexed, 30)


async def test_predicted_cached_tokens_equal_vllms_for_every_adapter(router, vllm):
    outcomes = []
    questions = ("What is a block?", "What is a cache?", "What is a block?")
    async with aiohttp.ClientSession() as session:
        for model in (*ADAPTERS, MODEL):  # the adapters first: the base model's blocks are not theirs
            for question in questions:
                body = {"model": model, "prompt": SYSTEM + question, "max_tokens": 2, "return_token_ids": True}
                async with session.post(router.url + "/v1/completions", json=body) as response:
                    assert response.status == 200, await response.text()
                    predicted = int(response.headers["x-kvroute-cached-tokens"])
                    reply = await response.json()
                reported = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
                outcomes.append((model, predicted, reported))
                prompt = reply["choices"][0]["prompt_token_ids"]
                await wait_indexed(router, prompt, None if model == MODEL else model)
    assert all(predicted == reported for _, predicted, reported in outcomes), outcomes
    # each model's first request found nothing of the others' (the same text); its later ones hit
    assert [reported for _, _, reported in outcomes[::3]] == [0, 0, 0], outcomes
    assert all(outcomes[i][2] > 0 for i in range(len(outcomes)) if i % 3), outcomes
