"""The router against real Redis, simulated engines (real HTTP/ZMQ) and agent processes."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import aiohttp
import pytest
from redis.asyncio import Redis

from kvindex.keys import KeySchema
from kvindex.redis_index import RedisIndex
from kvindex.shared_load import SharedLoad
from kvindex.types import WorkerInfo
from kvroute.devstack.embedded_redis import free_port
from router.main import RunningRouter
from tests.support import ROOT, SimFleet, wait_for_workers, wait_until
from tests.support.router import (
    PREFIX,
    complete,
    start_router,
    wait_indexed,
)


async def test_shared_prefixes_land_on_the_worker_that_holds_them(router, fleet):
    status, headers, body = await complete(router.url, [*PREFIX, 1])
    assert status == 200
    owner = headers["x-kvroute-worker"]
    assert await wait_indexed(router, PREFIX) == owner
    for tail in range(2, 8):
        status, headers, body = await complete(router.url, [*PREFIX, tail, tail])
        assert status == 200 and headers["x-kvroute-worker"] == owner
        assert int(headers["x-kvroute-cached-tokens"]) == 160
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 160
    other = [(i * 11) % 1900 + 5 for i in range(64)]
    assert (await complete(router.url, other))[0] == 200


async def test_a_cache_salt_separates_predictions_as_the_engine_does(router, fleet):
    status, headers, _ = await complete(router.url, [*PREFIX, 1], cache_salt="tenant-a")
    assert status == 200
    owner = headers["x-kvroute-worker"]
    assert await wait_indexed(router, PREFIX, salt="tenant-a") == owner
    status, headers, body = await complete(router.url, [*PREFIX, 2], cache_salt="tenant-a")
    assert headers["x-kvroute-worker"] == owner and int(headers["x-kvroute-cached-tokens"]) == 160
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 160
    # The same tokens under another salt (or none) share nothing, on the owner too.
    for salt in ("tenant-b", None):
        extra = {"cache_salt": salt} if salt else {}
        status, headers, body = await complete(router.url, [*PREFIX, 3], **extra)
        assert int(headers["x-kvroute-cached-tokens"]) == 0
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    status, _, body = await complete(router.url, [*PREFIX, 4], cache_salt=7)
    assert status == 400 and "cache_salt" in body["error"]["message"]


async def test_a_burst_of_different_prompts_spreads_instead_of_herding(router, fleet):
    """Prompts sharing only a short, cached prefix arrive together: each decision must see the
    bookings of the ones just before it (not yet in Redis), so they spread over the workers."""
    status, _, _ = await complete(router.url, [*PREFIX[:16], 1])
    assert status == 200
    await wait_indexed(router, PREFIX[:16])  # the prefix is indexed on one worker
    tails = [[(i * 13 + j) % 1900 + 10 for j in range(320)] for i in range(6)]
    replies = await asyncio.gather(*(complete(router.url, [*PREFIX[:16], *tail]) for tail in tails))
    workers = [headers["x-kvroute-worker"] for _, headers, _ in replies]
    assert len(set(workers)) == fleet.count, workers


async def test_a_burst_of_identical_prompts_is_not_scattered(router, fleet):
    prompt = [(i * 3) % 1900 + 20 for i in range(320)]
    results = await asyncio.gather(*(complete(router.url, prompt) for _ in range(6)))
    workers = [headers["x-kvroute-worker"] for _, headers, _ in results]
    # The first decision is "expected" for the rest; a worker already holding a deep queue of
    # them is worth one replica of the hot prompt, not one per request.
    assert len(set(workers)) <= 2, workers
    cold = [headers["x-kvroute-worker"] for _, headers, _ in results if headers["x-kvroute-cached-tokens"] == "0"]
    assert sorted(cold) == sorted(set(workers))  # only the first on each worker prefills it


async def test_debug_route_explains_without_proxying(router, fleet):
    await complete(router.url, [*PREFIX, 1])
    await wait_indexed(router, PREFIX)
    url, body = router.url + "/debug/route", {"model": "tiny", "prompt": PREFIX}
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
        explained = await response.json()
    assert explained["prompt_blocks"] == 10 and len(explained["workers"]) == 3
    best = explained["workers"][0]
    assert best["id"] == explained["chosen"] and best["matched_blocks"] == 10
    assert {"id", "url", "matched_blocks", "load", "cost"} <= set(best)


async def test_chat_and_streaming_pass_through(router, fleet):
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Hello " * 50}],
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with aiohttp.ClientSession() as session, session.post(router.url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        text = (await r.read()).decode()
    assert text.rstrip().endswith("data: [DONE]") and '"usage"' in text
    async with aiohttp.ClientSession() as session, session.get(router.url + "/metrics") as r:
        assert "kvroute_router_prompt_tokens_total" in await r.text()


async def test_a_client_that_goes_away_cancels_the_upstream_request(router, fleet):
    body = {"model": "tiny", "prompt": PREFIX, "max_tokens": 200, "stream": True}
    async with aiohttp.ClientSession() as session:
        response = await session.post(router.url + "/v1/completions", json=body)
        worker = response.headers["x-kvroute-worker"]
        await response.content.readline()
        response.close()
    engine = fleet.engine_of(worker).engine

    async def aborted() -> bool:
        return not engine.running and not engine.waiting

    await wait_until(aborted, 5)


@pytest.mark.parametrize(
    ("body", "status", "message", "param"),
    [
        (b"{not json", 400, "not valid JSON", None),
        (json.dumps({"model": "tiny"}).encode(), 400, "'prompt' is missing or empty", "prompt"),
        (json.dumps({"model": "tiny", "prompt": ""}).encode(), 400, "'prompt' is missing or empty", "prompt"),
        (b'{"model": "tiny", "prompt": "a\\ud800"}', 400, "\\ud800 is half of a UTF-16 surrogate pair", None),
        (json.dumps({"model": "nope", "prompt": "x"}).encode(), 404, "does not exist", None),
        (json.dumps({"prompt": "x"}).encode(), 400, "'model'", "model"),
        (json.dumps({"model": "tiny", "prompt": "x" * 5000}).encode(), 413, "exceeds", None),
        # vLLM answers these 400; the router says so before routing
        (
            json.dumps({"model": "tiny", "prompt": "x", "temperature": "hot"}).encode(),
            400,
            "'temperature'",
            "temperature",
        ),
        (json.dumps({"model": "tiny", "prompt": "x", "n": 0}).encode(), 400, "'n' must be an integer", "n"),
    ],
)
async def test_bad_requests_get_openai_errors(fleet, redis_server, body, status, message, param):
    context, router = await start_router(redis_server.url, max_body_bytes=4096)
    try:
        await wait_for_workers(router, fleet.count)
        headers = {"Content-Type": "application/json"}
        url = router.url + "/v1/completions"
        async with aiohttp.ClientSession() as session, session.post(url, data=body, headers=headers) as response:
            assert response.status == status
            error = (await response.json())["error"]
        assert message in error["message"] and error["code"] == status and error["param"] == param
        assert (await complete(router.url, "still serving"))[0] == 200
    finally:
        await context.__aexit__(None, None, None)  # type: ignore[attr-defined]


async def test_api_keys(fleet, redis_server):
    context, router = await start_router(redis_server.url, api_keys=frozenset({"k1"}))
    try:
        await wait_for_workers(router, fleet.count)
        status, headers, _ = await complete(router.url, "hi")
        assert status == 401 and headers["WWW-Authenticate"].startswith("Bearer ")  # RFC 9110: a 401 names its scheme
        async with aiohttp.ClientSession(headers={"Authorization": "Bearer k1"}) as session:
            body = {"model": "tiny", "prompt": "hi", "max_tokens": 1}
            async with session.post(router.url + "/v1/completions", json=body) as response:
                assert response.status == 200
                assert "Server" not in response.headers  # the engine's (aiohttp's, with versions) is not relayed
            async with session.get(router.url + "/health") as response:
                assert response.status == 200
    finally:
        await context.__aexit__(None, None, None)  # type: ignore[attr-defined]


async def test_no_alive_worker_is_503_and_dead_upstreams_502(redis_server):
    client = Redis.from_url(redis_server.url)
    index = RedisIndex(client)
    try:
        await index.register(WorkerInfo("gone", "ghost", f"http://127.0.0.1:{free_port()}", 16), ttl_ms=60_000)
        await index.register(WorkerInfo("down", "dead", f"http://127.0.0.1:{free_port()}", 16), ttl_ms=60_000)
        await index.register(WorkerInfo("x", "ghost", "http://127.0.0.1:1", 16), ttl_ms=60_000)
        await index.handle("ghost", "gone").heartbeat(ttl_ms=0)
        await index.handle("ghost", "x").heartbeat(ttl_ms=0)
        context, router = await start_router(redis_server.url)
        try:
            status, _, body = await complete(router.url, [1, 2, 3], model="ghost")
            assert status == 503 and "no alive worker" in body["error"]["message"]
            status, _, body = await complete(router.url, [1, 2, 3], model="dead")
            assert status == 502 and body["error"]["code"] == 502
        finally:
            await context.__aexit__(None, None, None)  # type: ignore[attr-defined]
    finally:
        await client.aclose()


async def test_a_streamed_request_stops_queueing_prefill_at_its_first_token(router, redis_server):
    """The booked uncached tokens (prefill that delays other requests) are released when the first
    token streams back; the request itself stays counted until it ends."""
    client = Redis.from_url(redis_server.url)
    load = SharedLoad(client, KeySchema(), "observer")
    body = {"model": "tiny", "prompt": [*PREFIX, 77], "max_tokens": 2000, "stream": True}
    try:
        async with aiohttp.ClientSession() as session, session.post(router.url + "/v1/completions", json=body) as r:
            assert r.status == 200
            await r.content.readline()  # the first token is out

            async def only_decoding() -> bool:
                totals = [t for t in (await load.totals("tiny")).values() if t.requests]
                return len(totals) == 1 and totals[0].uncached_tokens == 0 and totals[0].prompt_tokens == 161

            await wait_until(only_decoding, 5)
    finally:
        await client.aclose()


async def _hit_rate(urls: list[str], index: RunningRouter | RedisIndex, seed: int) -> float:
    """Multi-turn conversations (each turn extends the last prompt), spread over ``urls``."""
    rng = __import__("random").Random(seed)
    conversations = [[rng.randrange(10, 1900) for _ in range(48)] for _ in range(9)]
    prompt_tokens = cached_tokens = 0
    sent = 0
    for _turn in range(4):
        for conversation in conversations:
            conversation += [rng.randrange(10, 1900) for _ in range(40)]
            status, _, body = await complete(urls[sent % len(urls)], list(conversation))
            sent += 1
            assert status == 200
            prompt_tokens += body["usage"]["prompt_tokens"]
            cached_tokens += body["usage"]["prompt_tokens_details"]["cached_tokens"]
        for conversation in conversations:  # the turn's events have reached the index
            await wait_indexed(index, conversation[: len(conversation) // 16 * 16])
    return cached_tokens / prompt_tokens


async def test_four_replicas_route_as_well_as_one(fleet, redis_server):
    contexts, routers = [], []
    try:
        for _ in range(4):
            context, router = await start_router(redis_server.url)
            await wait_for_workers(router, fleet.count)
            contexts.append(context)
            routers.append(router)
        index = routers[0]  # wait_indexed reads the index through the router's port
        one = await _hit_rate([routers[0].url], index, seed=1)
        four = await _hit_rate([r.url for r in routers], index, seed=2)
        print(f"hit rate: 1 replica {one:.3f}, 4 replicas {four:.3f}")
        assert one > 0.5 and four >= 0.9 * one
    finally:
        for context in contexts:
            await context.__aexit__(None, None, None)  # type: ignore[attr-defined]


def test_bad_router_flags_exit_2_with_a_message():
    result = subprocess.run(
        [sys.executable, "-m", "kvroute", "router", "--tokenizer", "tiny"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "--tokenizer takes MODEL=DIR" in result.stderr


async def test_a_prompt_longer_than_the_engines_context_is_refused_by_the_router(redis_server):
    """The agents register their engines' max_model_len (from /v1/models): the router answers
    vLLM's 400 itself, and no engine is sent the prompt."""
    fleet = await SimFleet(redis_server.url, count=2, max_model_len=256).start()
    context, router = await start_router(redis_server.url)
    try:
        await wait_for_workers(router, fleet.count)
        assert router.state.fleet.context_length("tiny") == 256
        status, headers, reply = await complete(router.url, list(range(1, 301)))
        assert status == 400 and "x-kvroute-worker" not in headers, reply
        error = reply["error"]
        assert "maximum context length is 256 tokens" in error["message"] and error["param"] == "prompt"
        status, _, reply = await complete(router.url, list(range(1, 201)), max_tokens=100)
        assert status == 400 and reply["error"]["param"] == "max_tokens", reply
        assert sum(e.engine.stats.requests_finished for e in fleet.engines) == 0  # none reached an engine
        assert (await complete(router.url, list(range(1, 201)), max_tokens=8))[0] == 200
    finally:
        await context.__aexit__(None, None, None)  # type: ignore[attr-defined]
        await fleet.stop()
