"""The agent's event pipeline on random engine streams with lost batches.

Real Redis, the real replay socket (sim_engine's publisher, vLLM's wire), the real translator
and sequencer; only the SUB socket is left out: the test hands the pipeline each delivered
message, and simply withholds the lost ones. The engine is the toy engine of tests/support/toy_engine.py.
"""

from __future__ import annotations

import asyncio
import itertools

import zmq.asyncio
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis

from kvindex.hashing import sequence_hashes
from kvindex.redis_index import RedisIndex
from kvindex.types import WorkerInfo
from sim_engine.kv_events import KVEventPublisher
from tests.conftest import server_kinds
from tests.support.toy_engine import BS, DOCS, SALTS, STEPS, ToyEngine, engine_step
from worker_agent.metrics import AgentCounters, new_registry
from worker_agent.pipeline import EventPipeline, Received
from worker_agent.replay import ReplayClient
from worker_agent.writer import WorkerWriter

_models = itertools.count()
STREAMS = st.tuples(STEPS, st.lists(st.booleans(), min_size=40, max_size=40))


async def _served_and_indexed(index: RedisIndex, model: str, engine: ToyEngine) -> list[tuple[int, int]]:
    out = []
    for doc in range(len(DOCS)):
        for salt in SALTS:
            got = (await index.match(model, sequence_hashes(DOCS[doc], BS, cache_salt=salt))).get("w", -1)
            out.append((got, engine.served_prefix(doc, salt)))
    return out


async def _run(redis_url: str, steps: list[tuple], delivered: list[bool], with_replay: bool) -> None:
    model = f"streams-{next(_models)}"
    context = zmq.asyncio.Context()
    replay_endpoint = "tcp://127.0.0.1:*" if with_replay else None
    publisher = KVEventPublisher(context, "tcp://127.0.0.1:*", replay_endpoint, topic="kv").start()
    client = Redis.from_url(redis_url)
    counters = AgentCounters()
    writer = WorkerWriter(RedisIndex(client), counters, ttl_ms=60_000)
    replay = ReplayClient(context, publisher.replay_endpoint, 2.0) if publisher.replay_endpoint else None
    pipeline = EventPipeline(writer, replay, "kv", counters, new_registry()[1], block_size=BS)
    engine = ToyEngine()
    lost = 0
    try:
        assert await writer.register(WorkerInfo("w", model, "http://w", BS))
        # The last batch always arrives, so that every loss shows as a gap.
        for step, deliver in zip([*steps, ("store", 0, None, 4, True)], [*delivered[: len(steps)], True], strict=True):
            events = engine_step(engine, step)
            if not events:
                continue  # vLLM publishes no empty batches
            frames = await publisher.publish(events, deliver=False)
            if not deliver:
                lost += 1
                continue
            await pipeline.process([Received(frames)])
            pairs = await _served_and_indexed(writer.index, model, engine)
            if with_replay:
                assert all(got == served for got, served in pairs), f"after {step}: (index, engine) {pairs}"
            else:
                assert all(got <= served for got, served in pairs), f"after {step}: (index, engine) {pairs}"
        if with_replay or not lost:
            assert counters.resyncs == 0
        else:
            assert counters.resyncs >= 1
    finally:
        await publisher.close()
        await client.aclose()
        context.destroy(linger=0)


@settings(max_examples=60, deadline=None)
@given(STREAMS)
def test_with_replay_lost_batches_are_repaired_exactly(redis_servers, stream):
    steps, delivered = stream
    asyncio.run(_run(redis_servers[server_kinds()[0]].url, steps, delivered, with_replay=True))


@settings(max_examples=60, deadline=None)
@given(STREAMS)
def test_without_replay_the_index_never_claims_a_block_the_engine_lacks(redis_servers, stream):
    steps, delivered = stream
    asyncio.run(_run(redis_servers[server_kinds()[0]].url, steps, delivered, with_replay=False))
