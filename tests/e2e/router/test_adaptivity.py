"""The cost in time adapts to the regime, checked by its outcome (real Redis, engines, agents).

* Spare capacity: requests in flight that are past their prefill do not delay a new prompt's
  first token, so a conversation stays on the worker that holds it.
* One hot prefix and overloaded engines: the prefill queued on the holder outweighs the prefix,
  so the router spreads the load instead of herding onto it.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import aiohttp
import pytest

from router.routing.ttft import HALF_LIFE
from tests.support import SimFleet, wait_for_workers, wait_until
from tests.support.router import start_router, wait_indexed


async def _explain(session: aiohttp.ClientSession, url: str, prompt: list[int]) -> str:
    """What the router would decide now (for a failure's message)."""
    async with session.post(url + "/debug/route", json={"model": "tiny", "prompt": prompt}) as response:
        return await response.text()


def _tokens(seed: int, count: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 1900 + 10 for i in range(count)]


async def _complete(session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int = 2) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens}
    async with session.post(url + "/v1/completions", json=body) as response:
        assert response.status == 200
        await response.read()
        return response.headers["x-kvroute-worker"]


async def test_with_spare_capacity_a_conversation_stays_on_its_worker_while_it_is_busy(redis_server):
    # A cache large enough that the long decodes below never make the owner "busy" (KV usage >= 0.97).
    fleet = await SimFleet(redis_server.url, count=3, num_blocks=4096, speedup=20).start()
    context, router = await start_router(redis_server.url)
    streams: list[aiohttp.ClientResponse] = []
    try:
        await wait_for_workers(router, 3)
        conversation = _tokens(1, 480)  # 30 blocks
        async with aiohttp.ClientSession() as session:
            owner = await _complete(session, router.url, conversation)
            await wait_indexed(router, conversation)
            # Long requests on the owner, past their prefill (first token out), still decoding: they
            # hold KV there but delay nobody's prefill. The old cost charged 0.3 per in-flight
            # block (4 x 1,200 tokens = 300 blocks x 0.3 = 90 > the 30-block prefix) and moved away.
            for i in range(4):
                body = {"model": "tiny", "prompt": [*conversation, *_tokens(100 + i, 720)], "max_tokens": 2500}
                body["stream"] = True
                response = await session.post(router.url + "/v1/completions", json=body)
                assert response.status == 200 and response.headers["x-kvroute-worker"] == owner
                await response.content.readline()  # its first token: the prefill is done
                streams.append(response)
            for turn in range(3):
                conversation += _tokens(200 + turn, 48)
                worker = await _complete(session, router.url, conversation)
                assert worker == owner, await _explain(session, router.url, conversation)
                await wait_indexed(router, conversation[: len(conversation) // 16 * 16])
    finally:
        for response in streams:
            response.close()
        await context.__aexit__(None, None, None)  # type: ignore[attr-defined]
        await fleet.stop()


async def test_one_hot_prefix_on_overloaded_engines_is_spread(redis_server):
    # Slow prefill (each engine needs ~60 ms per 1k tokens at this speedup), a small batch limit.
    fleet = await SimFleet(redis_server.url, count=3, num_blocks=2048, speedup=2.5, max_running=2).start()
    context, router = await start_router(redis_server.url)
    try:
        await wait_for_workers(router, 3)
        hot = _tokens(7, 256)
        async with aiohttp.ClientSession() as session:
            holder = await _complete(session, router.url, hot)
            await wait_indexed(router, hot)
            # A burst: the hot prefix with long unique suffixes, far more prefill than one engine does.
            prompts = [[*hot, *_tokens(1000 + i, 1024)] for i in range(12)]
            workers = await asyncio.gather(*(_complete(session, router.url, p) for p in prompts))
        counts = Counter(workers)
        assert len(counts) == 3, counts
        assert counts[holder] <= 6, counts  # herding would put all 12 on the holder
    finally:
        await context.__aexit__(None, None, None)  # type: ignore[attr-defined]
        await fleet.stop()


async def test_a_non_streamed_request_stops_queueing_prefill_when_its_prefill_is_predicted_done(redis_server):
    """Its first byte comes with its last token: its prefill is released at the predicted TTFT."""
    fleet = await SimFleet(redis_server.url, count=2, speedup=20).start()
    context, router = await start_router(redis_server.url)
    load = router.state.load
    try:
        await wait_for_workers(router, 2)
        async with aiohttp.ClientSession() as session:
            reply = asyncio.create_task(_complete(session, router.url, _tokens(3, 800), max_tokens=2500))

            async def only_decoding() -> bool:
                booked = [b for b in load.inflight("tiny").values() if b.requests]
                return len(booked) == 1 and booked[0].uncached_tokens == 0 and booked[0].prompt_tokens == 800

            await wait_until(only_decoding, 10, interval=0.005)
            assert not reply.done()  # still decoding its 2,500 tokens
            await reply
        assert load.inflight("tiny") == {}
    finally:
        await context.__aexit__(None, None, None)  # type: ignore[attr-defined]
        await fleet.stop()


async def test_debug_model_shows_the_rate_learned_from_the_engines(redis_server):
    """GET /debug/model: what the router learned of real (simulated) engines from its streamed
    requests' first bytes."""
    fleet = await SimFleet(redis_server.url, count=2, speedup=20).start()
    context, router = await start_router(redis_server.url)
    try:
        await wait_for_workers(router, 2)
        async with aiohttp.ClientSession() as session:
            async with session.get(router.url + "/debug/model") as response:
                before = await response.json()
            assert response.status == 200 and before["source"] == "prior" and before["workers"] == []
            for i in range(8):
                body = {"model": "tiny", "prompt": _tokens(300 + i, 64 * (i + 1)), "max_tokens": 1, "stream": True}
                async with session.post(router.url + "/v1/completions", json=body) as reply:
                    assert reply.status == 200
                    await reply.read()
            async with session.get(router.url + "/debug/model") as response:
                learned = await response.json()
        assert learned["source"] == "streamed" and learned["observations"] == pytest.approx(8, abs=0.5)
        assert {w["id"] for w in learned["workers"]} <= {fleet.worker_id(i) for i in range(fleet.count)}
        assert sum(w["observations"] for w in learned["workers"]) == pytest.approx(8, abs=0.5)
        assert (
            learned["prefill_tokens_per_s"] > 0
            and learned["typical_uncached_tokens"] != before["typical_uncached_tokens"]
        )
    finally:
        await context.__aexit__(None, None, None)  # type: ignore[attr-defined]
        await fleet.stop()


async def test_whole_replies_teach_the_decode_apart_from_the_prefill(redis_server):
    """Requests not streamed: their time is the whole reply's; fitted with the completion tokens
    of each reply's usage, the decode's share is learned apart (the simulated engines decode a
    token per 1 ms of wall time at this speed-up) and the prefill rate and base exclude it."""
    fleet = await SimFleet(redis_server.url, count=2, num_blocks=1024, speedup=20).start()
    context, router = await start_router(redis_server.url)
    try:
        await wait_for_workers(router, 2)
        async with aiohttp.ClientSession() as session:
            for i in range(24):  # one at a time: no queue, so the time is prefill and decode alone
                await _complete(session, router.url, _tokens(400 + i, 64 * (1 + i % 8)), max_tokens=1 + (i * 7) % 48)
            async with session.get(router.url + "/debug/model") as response:
                learned = await response.json()
        decayed = sum((1 - 1 / HALF_LIFE) ** k for k in range(24))
        assert learned["source"] == "whole_replies" and learned["whole_reply_observations"] == pytest.approx(
            decayed, abs=0.2
        )
        assert 0.4 < learned["decode_ms_per_token"] < 3.0
        # The decode of ~24 tokens (~24 ms) on average is not taken for a wait before the first token.
        assert learned["base_ms"] < 15
    finally:
        await context.__aexit__(None, None, None)  # type: ignore[attr-defined]
        await fleet.stop()
