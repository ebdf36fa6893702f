"""A routed prompt's blocks are "expected" on its worker while its prefill is computed there, and
not after: once the engine's KV events have had time to reach the index, the index alone says
what the worker holds. A real router, real Redis, real HTTP; the worker (fake_worker) publishes no
KV events, as if its engine had evicted the prompt's blocks before they were indexed."""

from __future__ import annotations

import asyncio

from tests.support import wait_until
from tests.support.fake_worker import MODEL, FakeWorker, post, workers_and_router
from tests.support.router import start_router

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


async def test_another_replica_stops_expecting_a_prompt_when_the_booking_one_sees_its_first_byte(redis_server, index):
    """Two replicas on one Redis: the one that did not route the prompt sees it expected on its
    worker while it is prefilled there, and stops when the routing replica sees the reply start
    (settle.lua), however long the expected TTL: the replicas decide alike."""
    worker = FakeWorker("w1", mode="hold")
    async with workers_and_router(redis_server, index, [worker], expected_ttl_ms=600_000) as router:
        context, other = await start_router(redis_server.url, expected_ttl_ms=600_000)
        try:
            # The first replica finds the second at its next renewal after the second leased the
            # model (alone, a replica writes no expectation).
            await other.state.load.renew_all([MODEL])
            await router.state.load.renew_all([MODEL])
            assert not router.state.load.shared.alone(MODEL)
            held = asyncio.create_task(post(router.url + "/v1/completions", PROMPT))

            async def seen_by_the_other() -> bool:
                return worker.active == 1 and await _matched_blocks(other.url) == 4

            await wait_until(seen_by_the_other, 10)
            worker.release()
            status, _, _ = await held
            assert status == 200

            async def forgotten_by_the_other() -> bool:
                return await _matched_blocks(other.url) == 0

            await wait_until(forgotten_by_the_other, 10)
        finally:
            await context.__aexit__(None, None, None)  # type: ignore[attr-defined]
