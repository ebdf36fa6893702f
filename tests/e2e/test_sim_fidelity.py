"""Fidelity of the simulated engine: the same requests into a REAL vLLM and into the simulation.

Both get the same block count and block size (12 blocks of 32 tokens: evictions happen). The
flattened KV-event streams (batch boundaries aside) must be identical up to hash values and
timestamps: the same event types with the same keys, token ids, parent/child structure, extra
keys, and the same removals in the same order; and every request's cached token count must agree.
Generated tokens are the one exception: the simulation is not the model, so the ids it generates
differ; they are compared by position (each stream's are marked from its own engine's output).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import msgpack
import pytest
import zmq

from sim_engine.engine import TimingModel
from sim_engine.server import running_engine
from sim_engine.settings import SimEngineSettings
from tests.vllm_support import BS, MODEL, TINY_MODEL, VllmServer, vllm_server

pytestmark = pytest.mark.vllm

NUM_BLOCKS = 12
P = [(i * 7) % 1900 + 10 for i in range(64)]  # two blocks shared by several prompts
TEXT = ("The quick brown fox jumps over the lazy dog. " * 4).strip()


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
    return out


def subscribe(endpoint: str) -> tuple[zmq.Context, zmq.Socket]:
    context = zmq.Context()
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.RCVHWM, 0)
    socket.setsockopt(zmq.SUBSCRIBE, b"kv")
    socket.connect(endpoint)
    time.sleep(0.5)  # let the subscription reach the publisher
    return context, socket


def drain(socket: zmq.Socket, seqs: list[int]) -> list[dict[str, Any]]:
    events = []
    time.sleep(0.3)
    while True:
        try:
            _, seq, payload = socket.recv_multipart(flags=zmq.NOBLOCK)
        except zmq.Again:
            return events
        seqs.append(int.from_bytes(seq, "big"))
        events += msgpack.unpackb(payload, raw=False)[1]


async def drive(url: str, socket: zmq.Socket) -> tuple[list[int | None], list[tuple]]:
    """Send the requests one by one; each request's cached tokens, and the flattened events."""
    cached: list[int | None] = []
    seqs: list[int] = []
    names: dict[Any, int] = {}
    flat: list[tuple] = []
    async with aiohttp.ClientSession() as session:
        for path, body in requests():
            async with session.post(url + path, json={**body, "return_token_ids": True}) as response:
                assert response.status == 200, await response.text()
                reply = await response.json() if path != "/reset_prefix_cache" else {}
            prompt: list[int] = []
            output: list[int] = []
            if reply:
                cached.append((reply["usage"].get("prompt_tokens_details") or {}).get("cached_tokens"))
                choice = reply["choices"][0]
                prompt, output = choice.get("prompt_token_ids") or [], choice.get("token_ids") or []
            flat += [normalized(event, names, prompt, output) for event in drain(socket, seqs)]
    assert seqs == list(range(len(seqs))), f"missed batches: {seqs}"
    return cached, flat


def normalized(event: dict[str, Any], names: dict[Any, int], prompt: list[int], output: list[int]) -> tuple:
    """An event with hashes replaced by their order of first appearance, and the tokens the model
    generated replaced by -1."""

    def name(h: Any) -> int | None:
        return None if h is None else names.setdefault(h, len(names))

    kind = event["type"]
    if kind == "BlockRemoved":
        return (kind, tuple(event), tuple(name(h) for h in event["block_hashes"]), event["medium"])
    if kind != "BlockStored":
        return (kind, tuple(event))
    tokens = list(event["token_ids"])
    sequence = prompt + output
    for start in range(0, len(sequence) - len(tokens) + 1, BS):
        if sequence[start : start + len(tokens)] == tokens:
            tokens = [t if start + i < len(prompt) else -1 for i, t in enumerate(tokens)]
            break
    hashes = tuple(name(h) for h in event["block_hashes"])
    parent = name(event["parent_block_hash"])
    extra = repr(event["extra_keys"])
    return (kind, tuple(event), hashes, parent, tuple(tokens), event["block_size"], extra, event["medium"],
            event["lora_name"])  # fmt: skip


@pytest.fixture(scope="module")
def vllm() -> Iterator[VllmServer]:
    with vllm_server(num_blocks=NUM_BLOCKS) as server:
        yield server


async def test_the_simulation_emits_what_vllm_emits(vllm):
    context, socket = subscribe(f"tcp://127.0.0.1:{vllm.events_port}")
    try:
        real_cached, real_events = await drive(vllm.url, socket)
    finally:
        socket.close(linger=0)
        context.term()

    settings = SimEngineSettings(port=0, events_endpoint="tcp://127.0.0.1:*", topic="kv", model=MODEL,
                                 tokenizer=TINY_MODEL, num_blocks=NUM_BLOCKS, block_size=BS, max_model_len=256,
                                 timing=TimingModel(speedup=50))  # fmt: skip
    async with running_engine(settings) as sim:
        context, socket = subscribe(sim.events_endpoint)
        try:
            sim_cached, sim_events = await drive(sim.url, socket)
        finally:
            socket.close(linger=0)
            context.term()

    def short(events: list[tuple]) -> str:
        return "\n".join(f"{i}: {e[0]} {e[2] if len(e) > 2 else ''} parent={e[3] if len(e) > 3 else ''}"
                         for i, e in enumerate(events))  # fmt: skip

    kinds = {e[0] for e in real_events}
    assert {"BlockStored", "BlockRemoved", "AllBlocksCleared"} <= kinds, kinds  # the workload covers them all
    for i, (real, sim_event) in enumerate(zip(real_events, sim_events, strict=False)):
        assert sim_event == real, (
            f"event {i} differs:\n vLLM {real}\n sim  {sim_event}\n"
            f"vLLM:\n{short(real_events)}\nsim:\n{short(sim_events)}"
        )
    assert len(sim_events) == len(real_events)
    assert sim_cached == real_cached
