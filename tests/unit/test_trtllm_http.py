"""The agent's HTTP side of TensorRT-LLM, against real HTTP servers: the poller of its KV events
(worker_agent/poller.py), where events become inbox messages in order and what is not a list of
events is counted and skipped without stopping it; and its load and work from the iteration stats
of the simulated trtllm-serve (an idle engine runs no iteration: no work, so no false alarm)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from kvevents import trtllm
from kvroute.devstack.embedded_redis import free_port
from sim_engine.engine import TimingModel
from sim_engine.server import running_engine
from sim_engine.settings import SimEngineSettings
from worker_agent.engine import EngineClient
from worker_agent.engine_kinds import KINDS, TRTLLM
from worker_agent.inbox import Inbox
from worker_agent.metrics import AgentCounters
from worker_agent.poller import EventPoller


async def serve_events(handler) -> tuple[web.AppRunner, str]:
    """A server whose POST /kv_cache_events is ``handler``; its runner and that URL."""
    app = web.Application()
    app.router.add_post("/kv_cache_events", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}/kv_cache_events"


async def serve(answers: list[bytes]) -> tuple[web.AppRunner, str]:
    """A server whose POST /kv_cache_events gives ``answers`` in turn, then empty lists."""

    async def events(_: web.Request) -> web.Response:
        return web.Response(body=answers.pop(0) if answers else b"[]", content_type="application/json")

    return await serve_events(events)


async def test_events_become_messages_in_order_and_garbage_is_counted():
    good = [trtllm.created_json(0, [8, 0]), trtllm.removed_json(1, [5])]
    answers = [
        json.dumps(good).encode(),
        b"{}",
        b"not json",
        json.dumps([{"data": {}}, trtllm.removed_json(2, [6])]).encode(),
    ]
    runner, url = await serve(answers)
    counters = AgentCounters()
    inbox = Inbox(100, 1 << 20, counters)
    arrived = asyncio.Event()
    try:
        async with aiohttp.ClientSession() as session:
            poller = EventPoller(session, url, counters, interval_s=0.01)
            task = asyncio.create_task(poller.fill(inbox, arrived.set))
            taken = []
            while len(taken) < 3:
                taken += await asyncio.wait_for(inbox.take(10), 5)
            task.cancel()
    finally:
        await runner.cleanup()
    batches = [trtllm.decode_message(message.frames) for message in taken]
    assert [batch.seq for batch in batches] == [0, 1, 2] and arrived.is_set()
    assert counters.decode_errors == 3  # a map, a page of text, an event without an id


async def test_an_engine_that_does_not_answer_gives_nothing_and_the_poller_goes_on():
    async with aiohttp.ClientSession() as session:
        poller = EventPoller(session, f"http://127.0.0.1:{free_port()}/kv_cache_events", AgentCounters(), timeout_s=1)
        assert await poller.fetch() == []


async def test_the_iteration_stats_give_load_capacity_and_work_only_while_the_engine_runs():
    settings = SimEngineSettings(
        port=0, engine_kind="trtllm", block_size=32, num_blocks=64, timing=TimingModel(speedup=20)
    )
    async with running_engine(settings) as engine, aiohttp.ClientSession() as session:
        client = EngineClient(session, engine.url, 0)
        client.use_kind(KINDS[TRTLLM])
        before = await client.metrics(16)
        body = {"model": "tiny", "prompt": list(range(10, 80)), "max_tokens": 3}
        async with session.post(engine.url + "/v1/completions", json=body) as response:
            assert response.status == 200
        busy = await client.metrics(16)
        idle = await client.metrics(16)
    assert before is not None and busy is not None and idle is not None
    assert busy.load is not None and busy.load.capacity_blocks == 64 * 32 // 16
    assert before.work == 0 and busy.work is not None and busy.work > 1  # iterations and a completed request
    assert idle.work == busy.work and idle.load is not None and idle.load.running == 0


async def test_an_answer_that_arrives_in_pieces_is_read_whole():
    """The poll reads the engine's whole answer, however it is cut on the way (the engine drained
    its queue: a part read would be events lost)."""
    events = [trtllm.removed_json(n, [n + 1]) for n in range(3000)]
    body = json.dumps(events).encode()

    async def slow(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        for start in range(0, len(body), 8192):
            await response.write(body[start : start + 8192])
            await asyncio.sleep(0.002)
        await response.write_eof()
        return response

    runner, url = await serve_events(slow)
    counters = AgentCounters()
    try:
        async with aiohttp.ClientSession() as session:
            fetched = await EventPoller(session, url, counters).fetch()
    finally:
        await runner.cleanup()
    assert fetched == events and counters.decode_errors == 0
