"""Prompt size limits and long prompts (real router, real HTTP, simulated engines with agents):
a prompt over --max-prompt-tokens is a 413 in OpenAI's error shape, whichever way it came
(token ids, text through a worker's /tokenize, a chat), and a huge prompt does not stall the
router: /health is answered while it is being hashed."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvroute.devstack.embedded_redis import free_port
from tests.support import ROOT, wait_for_workers, wait_until
from tests.support.router import complete, start_router


async def _post(url: str, path: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session, session.post(url + path, json=body) as response:
        return response.status, await response.json(content_type=None)


async def _metric(session: aiohttp.ClientSession, url: str, name: str) -> float | None:
    async with session.get(url + "/metrics") as response:
        text = await response.text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    return None


async def test_a_prompt_over_the_token_limit_is_413_whichever_way_it_came(fleet, redis_server):
    context, router = await start_router(redis_server.url, max_prompt_tokens=100)
    try:
        await wait_for_workers(router, fleet.count)
        too_long = [
            ("/v1/completions", {"model": "tiny", "prompt": list(range(101))}, 101),
            ("/v1/completions", {"model": "tiny", "prompt": "word " * 150}, None),  # the worker tokenizes
            ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi " * 150}]}, None),
            ("/debug/route", {"model": "tiny", "prompt": list(range(500))}, 500),
        ]
        for path, body, tokens in too_long:
            status, reply = await _post(router.url, path, body)
            assert status == 413, (path, reply)
            message = reply["error"]["message"]
            assert reply["error"] == {"message": message, "type": "invalid_request_error", "param": None, "code": 413}
            assert "this router accepts at most 100 (--max-prompt-tokens)" in message and "\n" not in message
            if tokens is not None:
                assert message.startswith(f"the prompt has {tokens} tokens")
        assert (await complete(router.url, list(range(100))))[0] == 200  # at the limit: served
        assert (await complete(router.url, "word " * 20))[0] == 200
        async with aiohttp.ClientSession() as session:  # the /tokenize answer is kept as u32 ids
            assert await _metric(session, router.url, "kvroute_router_tokenize_cache_tokens") > 0
    finally:
        await context.__aexit__(None, None, None)  # type: ignore[attr-defined]


@pytest.mark.slow
async def test_health_is_answered_while_a_huge_prompt_is_hashed(fleet, redis_server):
    port = free_port()
    tokens = 2_000_000  # 125,000 blocks: ~0.1-0.2 s of hashing, in slices
    command = [sys.executable, "-m", "router", "--redis-url", redis_server.url, "--port", str(port)]
    command += ["--max-prompt-tokens", str(tokens), "--max-body-bytes", str(64 << 20), "--log-level", "WARNING"]
    command += ["--enable-debug"]
    process = subprocess.Popen(command, cwd=ROOT)  # noqa: ASYNC220 - starting it does not block
    url = f"http://127.0.0.1:{port}"
    body = json.dumps({"model": "tiny", "prompt": [(i * 7919) % 50_000 for i in range(tokens)]}).encode()
    try:
        async with aiohttp.ClientSession() as session:

            async def ready() -> bool:
                try:
                    async with session.get(url + "/ready") as response:
                        return response.status == 200 and len((await response.json())["models"]) == 1
                except aiohttp.ClientError:
                    return False

            await wait_until(ready, 30)
            headers = {"Content-Type": "application/json"}
            big = asyncio.create_task(_post_raw(url + "/debug/route", body, headers))
            # Probes in sequence: /metrics, /health, /metrics, /health, ... When the /metrics
            # answers on both sides of a /health say that the prompt is being hashed, that /health
            # was answered in the middle of the hashing: a router hashing in one go could not
            # answer any request then.
            bracketed = 0
            before = await _metric(session, url, "kvroute_router_prompts_hashing")
            while not big.done():
                async with session.get(url + "/health") as response:
                    healthy = response.status == 200
                after = await _metric(session, url, "kvroute_router_prompts_hashing")
                bracketed += bool(before and after and healthy)
                before = after
            status, reply = await big
            assert status == 200 and reply["prompt_blocks"] == tokens // 16, reply
            assert bracketed >= 1
            assert await _metric(session, url, "kvroute_router_prompts_sliced_total") == 1
    finally:
        process.terminate()
        await asyncio.to_thread(process.wait, 30)


async def _post_raw(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session, session.post(url, data=body, headers=headers) as response:
        return response.status, await response.json(content_type=None)
