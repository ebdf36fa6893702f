"""Fidelity of the simulated engine: the same requests into a REAL vLLM and into the simulation.

Both get the same block count and block size (12 blocks of 32 tokens: evictions happen). The
flattened KV-event streams (batch boundaries aside) must be identical up to hash values and
timestamps: the same event types with the same keys, token ids, parent/child structure, extra
keys, and the same removals in the same order; and every request's cached token count must agree.
Generated tokens are the one exception: the simulation is not the model, so the ids it generates
differ; they are compared by position (each stream's are marked from its own engine's output).
Both streams are read back from the engines' replay sockets once the last request's block is in
them (no subscriber that may join late, no fixed waits).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio

from sim_engine.engine import TimingModel
from sim_engine.kv_events import END_SEQ
from sim_engine.server import running_engine
from sim_engine.settings import SimEngineSettings
from tests.support import wait_until
from tests.support.vllm import BS, MODEL, VllmServer, vllm_server

pytestmark = pytest.mark.vllm

NUM_BLOCKS = 12
P = [(i * 7) % 1900 + 10 for i in range(64)]  # two blocks shared by several prompts
TEXT = ("The quick brown fox jumps over the lazy dog. " * 4).strip()
MARKER = list(range(1000, 1040))  # the last request: its block's BlockStored ends the stream


def requests() -> list[tuple[str, dict[str, Any]]]:
    """(endpoint, body) pairs, sent one after the other."""

    def completion(prompt: Any, max_tokens: int = 4, **extra: Any) -> tuple[str, dict[str, Any]]:
        return "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, **extra}

    out = [
        completion([*P, 500, 501, 502, 503, 504, 505]),  # 70 tokens: 2 full blocks
        completion([*P, 500, 501, 502, 503, 504, 505]),  # the same: a 2-block hit
        completion(P[:64] + list(range(600, 640))),  # shares both blocks, 104 tokens
        completion(P),  # exactly 2 blocks, all cached: the last one is recomputed (a duplicate store)
        completion(list(range(700, 740)), max_tokens=30),  # decoding fills a block
        completion([*P, 500, 501], cache_salt="tenant-a"),  # same tokens, another cache
        completion(TEXT),  # text, with BOS
        (
            "/v1/chat/completions",
            {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": TEXT}]},
        ),
    ]
    out += [completion([(n * 131 + i * 11) % 1900 + 20 for i in range(100)]) for n in range(5)]  # evictions
    out += [("/reset_prefix_cache", {}), completion([*P, 1, 2, 3])]  # AllBlocksCleared with the next step
    out += [completion([*P, 9, 9, 9, 9]) for _ in range(2)]
    return [*out, completion(MARKER, max_tokens=1)]


async def replayed(endpoint: str) -> tuple[list[int], list[dict[str, Any]]]:
    """Every batch the engine still buffers, asked for from seq 0 on its replay socket (DEALER):
    their seqs, and their events flattened."""
    context = zmq.asyncio.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.connect(endpoint)
    seqs: list[int] = []
    events: list[dict[str, Any]] = []
    try:
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        while (frames := await asyncio.wait_for(dealer.recv_multipart(), 10))[2] != END_SEQ:
            seqs.append(int.from_bytes(frames[2], "big"))
            events += msgpack.unpackb(frames[3], raw=False)[1]
    finally:
        dealer.close(linger=0)
        context.term()
    return seqs, events


async def drive(url: str, replay_endpoint: str) -> tuple[list[int | None], list[tuple]]:
    """Send the requests one by one; each request's cached tokens, and the flattened events."""
    cached: list[int | None] = []
    sequences: list[tuple[list[int], list[int]]] = []  # (prompt, output) per request
    async with aiohttp.ClientSession() as session:
        for path, body in requests():
            async with session.post(url + path, json={**body, "return_token_ids": True}) as response:
                assert response.status == 200, await response.text()
                reply = await response.json() if path != "/reset_prefix_cache" else {}
            if reply:
                cached.append((reply["usage"].get("prompt_tokens_details") or {}).get("cached_tokens"))
                choice = reply["choices"][0]
                sequences.append((choice.get("prompt_token_ids") or [], choice.get("token_ids") or []))
    got: list[tuple[list[int], list[dict[str, Any]]]] = []

    async def marker_seen() -> bool:  # vLLM publishes from a thread: the last batch may lag the reply
        got[:] = [await replayed(replay_endpoint)]
        return any(e["type"] == "BlockStored" and e["token_ids"] == MARKER[:BS] for e in got[0][1])

    await wait_until(marker_seen, 30)
    seqs, events = got[0]
    assert seqs == list(range(len(seqs))), f"missed batches: {seqs}"
    names: dict[Any, int] = {}
    return cached, [normalized(event, names, sequences) for event in events]


def generated(tokens: list[int], sequences: list[tuple[list[int], list[int]]]) -> list[int]:
    """A stored block's tokens with those the model generated replaced by -1: the block is found
    at a block boundary of the first request (prompt + output) that holds it."""
    for prompt, output in sequences:
        sequence = prompt + output
        for start in range(0, len(sequence) - len(tokens) + 1, BS):
            if sequence[start : start + len(tokens)] == tokens:
                return [t if start + i < len(prompt) else -1 for i, t in enumerate(tokens)]
    return tokens


def normalized(event: dict[str, Any], names: dict[Any, int], sequences: list[tuple[list[int], list[int]]]) -> tuple:
    """An event with hashes replaced by their order of first appearance, and the tokens the model
    generated replaced by -1."""

    def name(h: Any) -> int | None:
        return None if h is None else names.setdefault(h, len(names))

    kind = event["type"]
    if kind == "BlockRemoved":
        return (kind, tuple(event), tuple(name(h) for h in event["block_hashes"]), event["medium"])
    if kind != "BlockStored":
        return (kind, tuple(event))
    tokens = generated(list(event["token_ids"]), sequences)
    hashes = tuple(name(h) for h in event["block_hashes"])
    parent = name(event["parent_block_hash"])
    extra = repr(event["extra_keys"])
    return (
        kind,
        tuple(event),
        hashes,
        parent,
        tuple(tokens),
        event["block_size"],
        extra,
        event["medium"],
        event["lora_name"],
    )


@pytest.fixture(scope="module")
def vllm() -> Iterator[VllmServer]:
    with vllm_server(num_blocks=NUM_BLOCKS) as server:
        yield server


async def test_the_simulation_emits_what_vllm_emits(vllm):
    real_cached, real_events = await drive(vllm.url, f"tcp://127.0.0.1:{vllm.replay_port}")
    settings = SimEngineSettings(
        port=0,
        events_endpoint="tcp://127.0.0.1:*",
        replay_endpoint="tcp://127.0.0.1:*",
        topic="kv",
        model=MODEL,
        num_blocks=NUM_BLOCKS,
        block_size=BS,
        max_model_len=256,
        timing=TimingModel(speedup=50),
    )
    async with running_engine(settings) as sim:
        assert sim.replay_endpoint is not None
        sim_cached, sim_events = await drive(sim.url, sim.replay_endpoint)

    def short(events: list[tuple]) -> str:
        return "\n".join(
            f"{i}: {e[0]} {e[2] if len(e) > 2 else ''} parent={e[3] if len(e) > 3 else ''}"
            for i, e in enumerate(events)
        )

    kinds = {e[0] for e in real_events}
    assert {"BlockStored", "BlockRemoved", "AllBlocksCleared"} <= kinds, kinds  # the workload covers them all
    for i, (real, sim_event) in enumerate(zip(real_events, sim_events, strict=False)):
        assert sim_event == real, (
            f"event {i} differs:\n vLLM {real}\n sim  {sim_event}\n"
            f"vLLM:\n{short(real_events)}\nsim:\n{short(sim_events)}"
        )
    assert len(sim_events) == len(real_events)
    assert sim_cached == real_cached
