"""The agent's poller of an engine that hands out its KV events over HTTP (worker_agent/poller.py),
against a real HTTP server: events become inbox messages in order, and what is not a list of
events is counted and skipped without stopping it."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from kvevents import trtllm
from kvroute.devstack.embedded_redis import free_port
from worker_agent.inbox import Inbox
from worker_agent.metrics import AgentCounters
from worker_agent.poller import EventPoller


async def serve(answers: list[bytes]) -> tuple[web.AppRunner, str]:
    """A server whose POST /kv_cache_events gives ``answers`` in turn, then empty lists."""

    async def events(_: web.Request) -> web.Response:
        return web.Response(body=answers.pop(0) if answers else b"[]", content_type="application/json")

    app = web.Application()
    app.router.add_post("/kv_cache_events", events)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}/kv_cache_events"


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
