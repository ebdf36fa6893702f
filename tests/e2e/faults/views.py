"""The three views the fault suite compares: each simulated engine's own cache (its
``/debug/cache?detail=1``, rehashed the way the index hashes), the index in Redis (read by a fresh
reader, so no cached gid names), and each router's ``/debug/route`` for the probe prefixes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp

from kvindex.cluster import RedisClient
from kvindex.hashing import extend_sequence_hashes
from kvindex.redis_index import RedisIndex


async def engine_blocks(session: aiohttp.ClientSession, url: str, block_size: int) -> set[int]:
    """The index hashes of every block the engine caches whose whole chain it caches (the part
    an agent indexes: a block is indexed only under its parent)."""
    return set(await engine_block_parents(session, url, block_size))


async def engine_block_parents(session: aiohttp.ClientSession, url: str, block_size: int) -> dict[int, int | None]:
    """:func:`engine_blocks`, each with the index hash of its parent (None for a chain's first
    block): the chains the index stores it in."""
    async with session.get(url + "/debug/cache", params={"detail": "1"}) as response:
        response.raise_for_status()
        body = await response.json()
    content = {int(b["hash"], 16): b for b in body["blocks"]}
    hashed: dict[int, int | None] = {}
    parents: dict[int, int | None] = {}

    def index_hash(engine_hash: int) -> int | None:
        if engine_hash in hashed:
            return hashed[engine_hash]
        block = content.get(engine_hash)
        hashed[engine_hash] = None  # until known (a cycle would be a simulator bug: stays None)
        if block is None:
            return None
        parent = None if block["parent"] is None else index_hash(int(block["parent"], 16))
        if block["parent"] is not None and parent is None:
            return None
        salt, lora = (block["salt"], block.get("lora_name")) if parent is None else (None, None)
        value = extend_sequence_hashes(parent, block["token_ids"], block_size, lora_name=lora, cache_salt=salt)[0]
        hashed[engine_hash] = value
        parents[value] = parent
        return value

    indexed = {h for h in (index_hash(e) for e in content) if h is not None}
    return {h: parents[h] for h in indexed}


def chains_through(parents: dict[int, int | None]) -> list[list[int]]:
    """The chains, from their first block, that end at each block of ``parents`` (block -> its
    parent, None for a first block) with no child there: between them, every block whose whole
    chain is known."""
    inner = {p for p in parents.values() if p is not None}
    chains = []
    for leaf in set(parents) - inner:
        chain = [leaf]
        while (parent := parents.get(chain[-1])) is not None and len(chain) <= len(parents):
            chain.append(parent)
        if chain[-1] in parents and parents[chain[-1]] is None:
            chains.append(chain[::-1])
    return chains


async def index_blocks(client: RedisClient, model: str, parents: dict[int, int | None]) -> dict[str, set[int]]:
    """For each alive worker, which of the blocks in ``parents`` (block -> its parent) the index
    credits it with: a match down every chain they form (the index finds a block by its chain),
    all sent in one batch."""
    index = RedisIndex(client)
    chains = chains_through(parents)
    batches = [index.match_calls(model, chain) for chain in chains]
    replies = await index.scripts.call_many([call for calls in batches for call in calls])
    held: dict[str, set[int]] = {}
    at = 0
    for chain, calls in zip(chains, batches, strict=True):
        depths = await index.match_result(model, chain, replies[at : at + len(calls)])
        at += len(calls)
        for worker, depth in depths.items():
            held.setdefault(worker, set()).update(chain[:depth])
    return held


@dataclass
class RouteView:
    degraded: bool
    credits: dict[str, int] = field(default_factory=dict)  # worker -> blocks the index credits


async def route_view(session: aiohttp.ClientSession, router_url: str, prompt: list[int]) -> RouteView:
    """The router's explanation for ``prompt``: per worker, the matched blocks that come from the
    index (matched minus pending: "expected" prefixes of recent decisions are not index credits)."""
    body = {"model": "tiny", "prompt": prompt}
    async with session.post(router_url + "/debug/route", json=body) as response:
        if response.status != 200:
            return RouteView(degraded=True)
        explained = await response.json()
    credits = {w["id"]: w["matched_blocks"] - w["pending_blocks"] for w in explained["workers"]}
    return RouteView(explained["degraded"], credits)


def leading_run(chain: Sequence[int], held: set[int]) -> int:
    """How many leading blocks of ``chain`` are in ``held``."""
    run = 0
    for block in chain:
        if block not in held:
            break
        run += 1
    return run
