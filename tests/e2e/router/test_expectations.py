"""A routed prompt's blocks are "expected" on its worker while its prefill is computed there, and
not after: once the engine's KV events have had time to reach the index, the index alone says
what the worker holds. A real router, real Redis, real HTTP; the worker (fake_worker) publishes no
KV events, as if its engine had evicted the prompt's blocks before they were indexed."""

from __future__ import annotations

import asyncio

from tests.e2e.router.fake_worker import MODEL, FakeWorker, post, workers_and_router
from tests.support import wait_until

PROMPT = {"model": MODEL, "prompt": list(range(1, 65)), "max_tokens": 1}  # 4 full blocks of 16


async def _matched_blocks(router_url: str) -> int:
    status, _, explained = await post(router_url + "/debug/route", PROMPT)
    assert status == 200, explained
    return explained["workers"][0]["matched_blocks"]


async def test_a_prompt_is_expected_on_its_worker_while_in_flight_and_forgotten_after_its_reply(redis_server, index):
    worker = FakeWorker("w1", mode="hold")
    # A TTL far longer than the test: only the end of the prefill can end the expectation.
    async with workers_and_router(redis_server, index, [worker], expected_ttl_ms=600_000) as router:
        held = asyncio.create_task(post(router.url + "/v1/completions", PROMPT))

        async def in_flight() -> bool:
            return worker.active == 1

        await wait_until(in_flight, 10)
        assert await _matched_blocks(router.url) == 4  # being prefilled there: a burst shares it
        worker.release()
        status, headers, _ = await held
        assert status == 200 and headers["x-kvroute-cached-tokens"] == "0"

        async def forgotten() -> bool:
            return await _matched_blocks(router.url) == 0

        await wait_until(forgotten, 10)
        status, headers, _ = await post(router.url + "/v1/completions", PROMPT)  # the index has none
        assert status == 200 and headers["x-kvroute-cached-tokens"] == "0"
