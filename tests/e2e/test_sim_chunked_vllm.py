"""Chunked prefill against a REAL vLLM: the same small scenario, with the same token budget
(--max-num-batched-tokens 64), batch limit (--max-num-seqs 8) and cache (40 blocks of 32), into
vLLM 0.32's CPU server and into the simulation.

The scenario makes the order of arrivals irrelevant to the outcome: a "blocker" request (704
prompt tokens, 500 generated) holds so many blocks that the long prompt (608 tokens) cannot be
admitted beside it; while it decodes, the long prompt and then three short ones (64 tokens each)
are queued, each once the engine's /metrics shows it waiting. When the blocker finishes, the
queue is scheduled as vLLM v1 does: the long prompt in chunks of 64 (running requests take the
budget first), the first short one in the leftover of its last chunk, and so on.

What is compared, exactly:
* the KV-event batches (one per engine step that stores or removes blocks), each block named by
  its request and its index in it (hashes and generated tokens differ between the engines): the
  two sequences of batches must be identical. Every step from the long prompt's first chunk to
  the last short prompt's last one stores blocks, so those batches count the steps;
* from them, the step of each request's first token (prompts are whole blocks: the batch that
  stores a prompt's last block is the step that computes its last token);
* the order of the first tokens as the HTTP client sees them (the first streamed chunk), for the
  pairs of requests whose first tokens are at least two steps apart (a streamed chunk may hold
  back half a character until the next token, on either engine; neighbours are left to the
  event-derived steps).
Absolute times are not compared: the CPU engine's steps and the simulation's differ.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from sim_engine.engine import TimingModel
from sim_engine.kv_events import END_SEQ
from sim_engine.server import running_engine
from sim_engine.settings import SimEngineSettings
from tests.support import wait_until
from tests.support.vllm import BS, MODEL, VllmServer, vllm_server

pytestmark = pytest.mark.vllm

NUM_BLOCKS = 40  # 39 usable
BUDGET = 64
MAX_NUM_SEQS = 8
MAX_MODEL_LEN = 39 * BS  # vLLM refuses a model length its cache cannot hold


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(20, 2000) for _ in range(n)]


BLOCKER = tokens(1, 22 * BS)  # 22 blocks, then 500 generated tokens (38 blocks at the end)
LONG = tokens(2, 19 * BS)  # 19 blocks: 22 + 19 > 39, it waits for the blocker
SHORTS = [tokens(3 + n, 2 * BS) for n in range(3)]
PROMPTS = {"blocker": BLOCKER, "long": LONG, "s1": SHORTS[0], "s2": SHORTS[1], "s3": SHORTS[2]}
QUEUED = ["long", "s1", "s2", "s3"]


def chunked_vllm_server() -> AbstractContextManager[VllmServer]:
    """tests.support.vllm's server with this scenario's scheduler limits and model length."""
    limits = ["--max-num-batched-tokens", str(BUDGET), "--max-num-seqs", str(MAX_NUM_SEQS)]
    return vllm_server(NUM_BLOCKS, MAX_MODEL_LEN, limits)


async def batches(endpoint: str) -> list[list[dict[str, Any]]]:
    """Every batch the engine buffers, from seq 0, read from its replay socket."""
    context = zmq.asyncio.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.connect(endpoint)
    out: list[list[dict[str, Any]]] = []
    try:
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        while (frames := await asyncio.wait_for(dealer.recv_multipart(), 10))[2] != END_SEQ:
            out.append(msgpack.unpackb(frames[3], raw=False)[1])
    finally:
        dealer.close(linger=0)
        context.term()
    return out


def described(raw: list[list[dict[str, Any]]]) -> list[list[tuple[str, str, int]]]:
    """Each batch as (kind, request, block index) per block: a chain's first block is named by
    its prompt's first block of tokens, the others by their parent."""
    owner: dict[Any, tuple[str, int]] = {}
    out = []
    for events in raw:
        items: list[tuple[str, str, int]] = []
        for event in events:
            if event["type"] == "BlockStored":
                parent = event["parent_block_hash"]
                if parent is None:
                    name = next(n for n, p in PROMPTS.items() if list(event["token_ids"][:BS]) == p[:BS])
                    start = 0
                else:
                    name, start = owner[parent][0], owner[parent][1] + 1
                for k, block_hash in enumerate(event["block_hashes"]):
                    owner[block_hash] = (name, start + k)
                    items.append(("stored", name, start + k))
            elif event["type"] == "BlockRemoved":
                items += [("removed", *owner.get(h, ("?", -1))) for h in event["block_hashes"]]
            else:
                items.append((event["type"], "", -1))
        out.append(items)
    return out


def first_token_steps(steps: list[list[tuple[str, str, int]]]) -> dict[str, int]:
    """For each queued request: the step of its first token, counted from the long prompt's first
    chunk (0): the batch that stores its prompt's last block."""
    start = next(i for i, items in enumerate(steps) if ("stored", "long", 0) in items)
    last = {name: len(PROMPTS[name]) // BS - 1 for name in QUEUED}
    return {
        name: next(i for i, items in enumerate(steps) if ("stored", name, last[name]) in items) - start
        for name in QUEUED
    }


async def gauges(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(url + "/metrics") as response:
        text = await response.text()
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting")
    return {f.name: f.samples[0].value for f in text_string_to_metric_families(text) if f.name in names}


async def drive(url: str, replay_endpoint: str) -> tuple[list[list[tuple[str, str, int]]], dict[str, float]]:
    """Run the scenario: the event batches described, and when the client saw each first token."""
    loop = asyncio.get_running_loop()
    first_seen: dict[str, float] = {}

    async def stream(session: aiohttp.ClientSession, name: str, max_tokens: int) -> None:
        body = {
            "model": MODEL,
            "prompt": PROMPTS[name],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        async with session.post(url + "/v1/completions", json=body) as response:
            assert response.status == 200, await response.text()
            async for line in response.content:
                if line.startswith(b"data: {") and json.loads(line[6:])["choices"]:
                    first_seen.setdefault(name, loop.time())

    async with aiohttp.ClientSession() as session:
        tasks = [asyncio.create_task(stream(session, "blocker", 500))]

        async def blocker_decodes() -> bool:
            return "blocker" in first_seen

        await wait_until(blocker_decodes, 60, interval=0.01)
        for waiting, name in enumerate(QUEUED, 1):
            tasks.append(asyncio.create_task(stream(session, name, 4)))

            async def queued(waiting: int = waiting) -> bool:
                return await gauges(session, url) == {
                    "vllm:num_requests_running": 1,
                    "vllm:num_requests_waiting": waiting,
                }

            await wait_until(queued, 30, interval=0.01)
        assert "long" not in first_seen and not tasks[0].done(), "the blocker finished before the queue formed"
        await asyncio.gather(*tasks)

    got: list[list[dict[str, Any]]] = []

    async def last_block_published() -> bool:  # vLLM publishes from a thread: the last batch may lag
        got[:] = await batches(replay_endpoint)
        return ("stored", "s3", len(SHORTS[2]) // BS - 1) in [i for items in described(got) for i in items]

    await wait_until(last_block_published, 30)
    return described(got), first_seen


@pytest.fixture(scope="module")
def vllm() -> Iterator[VllmServer]:
    with chunked_vllm_server() as server:
        yield server


async def test_chunked_prefill_schedules_steps_as_vllm_does(vllm):
    real_steps, real_seen = await drive(vllm.url, f"tcp://127.0.0.1:{vllm.replay_port}")
    settings = SimEngineSettings(
        port=0,
        events_endpoint="tcp://127.0.0.1:*",
        replay_endpoint="tcp://127.0.0.1:*",
        topic="kv",
        model=MODEL,
        num_blocks=NUM_BLOCKS,
        block_size=BS,
        max_model_len=MAX_MODEL_LEN,
        timing=TimingModel(decode_ms_per_step=5, max_num_batched_tokens=BUDGET, max_num_seqs=MAX_NUM_SEQS, speedup=1),
    )
    async with running_engine(settings) as sim:
        assert sim.replay_endpoint is not None
        sim_steps, sim_seen = await drive(sim.url, sim.replay_endpoint)

    def show(steps: list[list[tuple[str, str, int]]]) -> str:
        return "\n".join(f"{i}: {items}" for i, items in enumerate(steps))

    assert sim_steps == real_steps, f"vLLM:\n{show(real_steps)}\nsim:\n{show(sim_steps)}"
    # the long prompt: 9 chunks of 64 and one of 32; the short ones one step after the other
    expected = {"long": 9, "s1": 10, "s2": 11, "s3": 12}
    assert first_token_steps(real_steps) == first_token_steps(sim_steps) == expected
    for seen in (real_seen, sim_seen):
        for a in QUEUED:
            for b in QUEUED:
                if expected[b] - expected[a] >= 2:
                    assert seen[a] < seen[b], (a, b, seen)
