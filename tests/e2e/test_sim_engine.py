"""The simulated engine over real HTTP and real ZMQ, in-process (the process and its start-up:
test_sim_engine_startup.py)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

import aiohttp
import pytest
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from kvevents.vllm import BlockStored, decode_message
from kvservice.logs import FIELDS
from sim_engine.engine import TimingModel
from sim_engine.server import RunningEngine, running_engine
from sim_engine.settings import SimEngineSettings
from tests.support import wait_until

BS = 16
PROMPT = list(range(100, 164))  # 4 blocks


def settings(**overrides) -> SimEngineSettings:
    base = {
        "port": 0,
        "events_endpoint": "tcp://127.0.0.1:*",
        "replay_endpoint": "tcp://127.0.0.1:*",
        "topic": "kv",
        "num_blocks": 64,
        "block_size": BS,
        "max_model_len": 512,
        "timing": TimingModel(speedup=100),
    }
    return SimEngineSettings(**{**base, **overrides})


@pytest.fixture
async def sim() -> AsyncIterator[RunningEngine]:
    async with running_engine(settings()) as running:
        yield running


async def post(url: str, body: object, path: str = "/v1/completions") -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session, session.post(url + path, json=body) as response:
        return response.status, await response.json()


async def test_completions_report_cached_tokens_like_vllm(sim):
    status, first = await post(sim.url, {"model": "tiny", "prompt": PROMPT, "max_tokens": 3})
    assert status == 200 and first["object"] == "text_completion"
    assert first["usage"] == {
        "prompt_tokens": 64,
        "total_tokens": 67,
        "completion_tokens": 3,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    _, again = await post(sim.url, {"model": "tiny", "prompt": PROMPT, "max_tokens": 3})
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 48  # 4 blocks, capped at len - 1
    _, longer = await post(sim.url, {"model": "tiny", "prompt": [*PROMPT, 7, 8], "max_tokens": 1})
    assert longer["usage"]["prompt_tokens_details"]["cached_tokens"] == 64


async def test_text_batch_and_chat_prompts(sim):
    status, body = await post(sim.url, {"model": "tiny", "prompt": ["Hello there", [5, 6, 7]], "max_tokens": 2})
    assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1]
    _, tokenized = await post(sim.url, {"model": "tiny", "prompt": "Hello there"}, "/tokenize")
    assert body["usage"]["prompt_tokens"] == tokenized["count"] + 3
    chat_body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    status, chat = await post(sim.url, chat_body, "/v1/chat/completions")
    assert status == 200 and chat["choices"][0]["message"]["role"] == "assistant"
    hi = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}
    _, tokenized = await post(sim.url, hi, "/tokenize")
    assert chat["usage"]["prompt_tokens"] == tokenized["count"]


async def test_streaming_ends_with_usage_and_done(sim):
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with aiohttp.ClientSession() as session, session.post(sim.url + "/v1/completions", json=body) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        lines = [line.decode().strip() for line in [line async for line in response.content] if line.strip()]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    _, whole = await post(sim.url, {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "return_token_ids": True})
    assert "token_ids" in whole["choices"][0]


async def test_chat_streaming_opens_with_the_role(sim):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True}
    async with (
        aiohttp.ClientSession() as session,
        session.post(sim.url + "/v1/chat/completions", json=body) as response,
    ):
        lines = [line.decode().strip() for line in [line async for line in response.content] if line.strip()]
    first = json.loads(lines[0][len("data: ") :])
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"] == {
        "role": "assistant",
        "content": "",
    }


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"model": "other", "prompt": "x"}, 404, "does not exist"),
        ({"model": "tiny"}, 400, "'prompt' is missing or empty"),
        ({"model": "tiny", "prompt": [1, 99999]}, 400, "out of vocabulary"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "'max_tokens' must be an integer of at least 1"),
        ({"model": "tiny", "prompt": "x", "temperature": "hot"}, 400, "'temperature' must be a number"),
        ({"model": "tiny", "prompt": "x", "n": 0}, 400, "'n' must be an integer of at least 1"),
        ({"model": "tiny", "prompt": ""}, 400, "'prompt' is missing or empty"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 600}, 400, "maximum context length is 512"),
        ({"model": "tiny", "prompt": "x", "cache_salt": 3}, 400, "cache_salt"),
        ([1, 2], 400, "JSON object"),
    ],
)
async def test_bad_requests_get_openai_errors_and_the_engine_keeps_serving(sim, body, status, message):
    got, error = await post(sim.url, body)
    assert got == status and message in error["error"]["message"] and error["error"]["code"] == status
    if status == 400 and "'" in message:  # a field at fault is named in param, as vLLM's errors do
        assert error["error"]["param"] == message.split("'")[1]
    ok, _ = await post(sim.url, {"model": "tiny", "prompt": "fine", "max_tokens": 1})
    assert ok == 200


async def test_malformed_json_is_a_400(sim):
    async with (
        aiohttp.ClientSession() as session,
        session.post(sim.url + "/v1/completions", data=b"{nope", headers={"Content-Type": "application/json"}) as r,
    ):
        assert r.status == 400 and "not valid JSON" in (await r.json())["error"]["message"]


async def test_models_health_metrics_and_reset(sim):
    async with aiohttp.ClientSession() as session:
        async with session.get(sim.url + "/v1/models") as r:
            assert [m["id"] for m in (await r.json())["data"]] == ["tiny"]
        async with session.get(sim.url + "/health") as r:
            assert r.status == 200
        await post(sim.url, {"model": "tiny", "prompt": PROMPT, "max_tokens": 2})
        async with session.get(sim.url + "/metrics") as r:
            families = {f.name: f for f in text_string_to_metric_families(await r.text())}
        async with session.post(sim.url + "/reset_prefix_cache") as r:
            assert r.status == 200
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
        "vllm:cache_config_info",
        "vllm:time_to_first_token_seconds",
    ):
        assert name in families, name
    info = families["vllm:cache_config_info"].samples[0].labels
    assert (info["block_size"], info["num_gpu_blocks"]) == (str(BS), "64")
    _, after = await post(sim.url, {"model": "tiny", "prompt": PROMPT, "max_tokens": 1})
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the reset forgot the blocks


PROBE = [b"kv", b"probe"]  # frames on the PUB socket that are no batch: seq and buffer unchanged


async def joined(sim: RunningEngine, sub: zmq.asyncio.Socket) -> None:
    """Until ``sub``'s subscription has reached the publisher (ZMQ's slow joiner): it receives probes."""

    async def probe_arrives() -> bool:
        assert sim.publisher is not None
        await sim.publisher.send_raw(PROBE)
        return await sub.poll(50) != 0 and await sub.recv_multipart() == PROBE

    await wait_until(probe_arrives, 10)


async def next_batch(sub: zmq.asyncio.Socket) -> list[bytes]:
    while (frames := await asyncio.wait_for(sub.recv_multipart(), 5)) == PROBE:
        pass
    return frames


async def test_events_and_replay_are_vllms_wire(sim):
    context = zmq.asyncio.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(sim.events_endpoint)
    try:
        await joined(sim, sub)
        await post(sim.url, {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "cache_salt": "s1"})
        batch = decode_message(await next_batch(sub))
        (stored,) = batch.events
        assert isinstance(stored, BlockStored) and stored.token_ids == tuple(PROMPT) and stored.block_size == BS
        assert stored.extra_keys == (["s1"], None, None, None) and stored.parent_block_hash is None
        dealer = context.socket(zmq.DEALER)
        dealer.connect(sim.replay_endpoint)
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = await asyncio.wait_for(dealer.recv_multipart(), 5)
        end = await asyncio.wait_for(dealer.recv_multipart(), 5)
        assert replayed[1:] == [b"kv", (0).to_bytes(8, "big"), replayed[3]] and decode_message(replayed[1:]).seq == 0
        assert end == [b"", b"", b"\xff" * 8, b""]
        dealer.close(linger=0)
    finally:
        sub.close(linger=0)
        context.destroy(linger=0)


async def test_cache_hits_cut_time_to_first_token_and_overload_queues():
    slow = TimingModel(prefill_ms_per_1k_tokens=4000, decode_ms_per_step=5, step_overhead_ms=0, max_running=1)
    async with running_engine(settings(timing=slow, num_blocks=256, max_model_len=2048)) as sim:
        prompt = [(i * 13) % 1900 + 10 for i in range(800)]

        async def ttft(body: dict) -> float:
            loop = asyncio.get_running_loop()
            started = loop.time()
            body = {"model": "tiny", "max_tokens": 1, **body}
            status, _ = await post(sim.url, body)
            assert status == 200
            return loop.time() - started

        miss = await ttft({"prompt": prompt})
        hit = await ttft({"prompt": prompt})
        assert hit < miss / 4, (hit, miss)  # ~3.2 s of prefill against none
        first = asyncio.create_task(post(sim.url, {"model": "tiny", "prompt": PROMPT, "max_tokens": 50}))

        async def queued() -> bool:
            return len(sim.engine.running) == 1

        await wait_until(queued, 5)
        second = asyncio.create_task(post(sim.url, {"model": "tiny", "prompt": [*PROMPT, 1], "max_tokens": 1}))

        async def waiting() -> bool:
            return len(sim.engine.waiting) == 1

        await wait_until(waiting, 5)  # the batch limit is 1: the second request waits
        await asyncio.gather(first, second)


async def test_a_client_that_goes_away_frees_its_blocks(sim):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 400, "stream": True}
    async with aiohttp.ClientSession() as session:
        response = await session.post(sim.url + "/v1/completions", json=body)
        await response.content.readline()
        response.close()

    async def freed() -> bool:
        return not sim.engine.running and sim.engine.pool.num_free == 63

    await wait_until(freed, 5)


async def test_probes_log_at_debug_and_requests_at_info(sim, caplog):
    caplog.set_level(logging.DEBUG, logger="sim_engine.access")
    async with aiohttp.ClientSession() as session:
        for path in ("/health", "/metrics"):
            async with session.get(sim.url + path) as response:
                assert response.status == 200
    await post(sim.url, {"prompt": "hello", "max_tokens": 1})
    levels = {getattr(r, FIELDS)["path"]: r.levelno for r in caplog.records if r.name == "sim_engine.access"}
    assert levels == {"/health": logging.DEBUG, "/metrics": logging.DEBUG, "/v1/completions": logging.INFO}


async def test_debug_match_answers_the_prefix_hit_a_prompt_would_get_now(sim):
    status, before = await post(sim.url, {"prompt": PROMPT}, "/debug/match")
    assert status == 200 and before == {"prompt_tokens": 64, "cached_tokens": 0, "running": 0, "waiting": 0}
    await post(sim.url, {"model": "tiny", "prompt": PROMPT, "max_tokens": 1})
    _, after = await post(sim.url, {"prompt": PROMPT + [7] * 20}, "/debug/match")
    assert after["cached_tokens"] == 64  # the cached blocks, whole
    status, reply = await post(sim.url, {"model": "tiny", "prompt": PROMPT + [7] * 20, "max_tokens": 1})
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == after["cached_tokens"]
    _, salted = await post(sim.url, {"prompt": PROMPT, "cache_salt": "other"}, "/debug/match")
    assert salted["cached_tokens"] == 0
    chat = {"messages": [{"role": "user", "content": "hello there"}]}
    status, answer = await post(sim.url, chat, "/debug/match")
    assert status == 200 and answer["prompt_tokens"] > 0
    status, error = await post(sim.url, {"prompt": 5}, "/debug/match")
    assert status == 400 and "prompt" in error["error"]["message"]


async def test_minimal_metrics_export_only_the_three_gauges():
    async with running_engine(settings(metrics="minimal")) as engine, aiohttp.ClientSession() as session:
        await post(engine.url, {"model": "tiny", "prompt": PROMPT, "max_tokens": 1})
        async with session.get(engine.url + "/metrics") as r:
            public = {f.name for f in text_string_to_metric_families(await r.text())}
        async with session.get(engine.url + "/debug/metrics") as r:
            everything = {s.name: s.value for f in text_string_to_metric_families(await r.text()) for s in f.samples}
    assert public == {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"}
    assert everything["vllm:request_success_total"] == 1 and "vllm:cache_config_info" in everything


def test_a_metrics_mode_that_does_not_exist_is_named():
    with pytest.raises(ValueError, match="--metrics must be one of full, minimal"):
        settings(metrics="some")


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n", "Invalid header value char"),
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "chunk size"),
        (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n", "Got more than"),
    ],
    ids=["nul-in-header", "bad-chunk", "100kb-header"],
)
async def test_malformed_http_gets_an_openai_400_and_one_quiet_log_line(sim, raw, reason, caplog):
    """aiohttp answered these itself: text/plain echoing the client's bytes, an ERROR with a traceback."""
    host, port = sim.url.removeprefix("http://").split(":")
    with caplog.at_level(logging.INFO):
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(raw)
        await writer.drain()
        reply = await reader.read()  # the connection is closed after the answer
        writer.close()
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.split(b"\r\n")[0].endswith(b"400 Bad Request") and b"application/json" in head
    error = json.loads(body)["error"]
    assert error["code"] == 400 and error["type"] == "BadRequestError" and reason in error["message"]
    assert b"aaaa" not in body and b"\\x00" not in body  # the client's bytes are not echoed
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info], caplog.records
    ok, _ = await post(sim.url, {"model": "tiny", "prompt": "fine", "max_tokens": 1})
    assert ok == 200
