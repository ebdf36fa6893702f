"""The greedy oracle (kvroute.devstack.oracle), a real process in front of real simulated engines:
it sends a prompt where the engines' own caches hold its longest prefix, ties to the fewest in
flight, and passes the reply through."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

import aiohttp
import pytest

from kvroute.devstack.peers import GreedyOracle
from sim_engine.engine import TimingModel
from sim_engine.server import running_engine
from sim_engine.settings import SimEngineSettings
from tests.support import wait_until

PROMPT = list(range(100, 164))  # 4 blocks of 16


def engine_settings(decode_ms: float = 1.0) -> SimEngineSettings:
    timing = TimingModel(speedup=10, decode_ms_per_step=decode_ms, prefill_ms_per_1k_tokens=10)
    return SimEngineSettings(port=0, events_endpoint=None, num_blocks=64, block_size=16, timing=timing)


async def complete(session: aiohttp.ClientSession, url: str, prompt, **extra) -> aiohttp.ClientResponse:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, **extra}
    async with session.post(url + "/v1/completions", json=body) as response:
        await response.read()
        return response


async def test_the_oracle_sends_each_prompt_where_its_longest_prefix_is_cached_now():
    async with AsyncExitStack() as stack:
        engines = [await stack.enter_async_context(running_engine(engine_settings())) for _ in range(3)]
        oracle = await stack.enter_async_context(GreedyOracle([e.url for e in engines], replicas=2))
        session = await stack.enter_async_context(aiohttp.ClientSession())
        assert len(oracle.urls) == 2 and len(set(oracle.urls)) == 1  # one process for every replica
        await complete(session, engines[2].url, PROMPT)  # warm engine 2's cache behind the oracle's back
        await complete(session, engines[1].url, PROMPT[:32])  # engine 1 holds half of it
        for _ in range(3):
            reply = await complete(session, oracle.urls[0], PROMPT + [9] * 16)
            assert reply.status == 200 and reply.headers["x-kvroute-worker"] == engines[2].url
            assert reply.headers["x-kvroute-cached-tokens"] == "64"
        reply = await complete(session, oracle.urls[1], PROMPT[:32] + [5] * 16)
        assert reply.headers["x-kvroute-worker"] in (engines[1].url, engines[2].url)  # both hold 32 tokens
        streamed = await complete(session, oracle.urls[0], PROMPT, stream=True)
        assert streamed.status == 200 and streamed.headers["Content-Type"].startswith("text/event-stream")


async def test_a_tie_goes_to_the_engine_with_the_fewest_requests_in_flight():
    async with AsyncExitStack() as stack:
        engines = [await stack.enter_async_context(running_engine(engine_settings(decode_ms=50))) for _ in range(2)]
        oracle = await stack.enter_async_context(GreedyOracle([e.url for e in engines]))
        session = await stack.enter_async_context(aiohttp.ClientSession())

        async def long(prompt):
            return await complete(session, oracle.urls[0], prompt, max_tokens=40)

        # two cold prompts at once: the second sees the first in flight and takes the other engine
        first = asyncio.create_task(long([7] * 40))

        async def running() -> bool:
            return any(e.engine.running for e in engines)

        await wait_until(running)
        second = await long([8] * 40)
        assert (await first).headers["x-kvroute-worker"] != second.headers["x-kvroute-worker"]


async def test_a_malformed_request_is_a_400_and_the_oracle_keeps_serving():
    async with AsyncExitStack() as stack:
        engine = await stack.enter_async_context(running_engine(engine_settings()))
        oracle = await stack.enter_async_context(GreedyOracle([engine.url]))
        session = await stack.enter_async_context(aiohttp.ClientSession())
        for body in (b"{not json", b"[1, 2]", b'{"prompt": 3}'):
            async with session.post(oracle.urls[0] + "/v1/completions", data=body) as response:
                assert response.status == 400 and "message" in (await response.json())["error"]
        assert (await complete(session, oracle.urls[0], PROMPT)).status == 200


@pytest.mark.parametrize("text", ["a text prompt, tokenized as the engine does", None])
async def test_text_and_chat_prompts_are_matched_as_the_engine_tokenizes_them(text):
    async with AsyncExitStack() as stack:
        engines = [await stack.enter_async_context(running_engine(engine_settings())) for _ in range(2)]
        oracle = await stack.enter_async_context(GreedyOracle([e.url for e in engines]))
        session = await stack.enter_async_context(aiohttp.ClientSession())
        if text is not None:
            long_text = " ".join([text] * 12)
            await complete(session, engines[1].url, long_text)
            reply = await complete(session, oracle.urls[0], long_text + " and more")
        else:
            messages = [{"role": "system", "content": "You route. " * 30}, {"role": "user", "content": "hi"}]
            chat = {"model": "tiny", "messages": messages, "max_tokens": 1}
            async with session.post(engines[1].url + "/v1/chat/completions", json=chat) as warm:
                assert warm.status == 200
            async with session.post(oracle.urls[0] + "/v1/chat/completions", json=chat) as reply:
                await reply.read()
        assert reply.headers["x-kvroute-worker"] == engines[1].url
        assert int(reply.headers["x-kvroute-cached-tokens"]) >= 64
