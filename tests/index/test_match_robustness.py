"""A match is right for every worker even when the index is damaged: evicted or deleted segment
keys, holdings added by hand for other gids, stores of a block as a chain's start. A gid is
credited with depth d only if its own holdings in Redis cover blocks 0..d-1: a holding that ends
at the last block of every page before d, and in the page where it stops a branch of its own
that shares the prompt's blocks up to d (the oracle below reads exactly that, field by field).
No damage to one worker's holdings can move another worker's match."""

from __future__ import annotations

import asyncio
import itertools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis

from kvindex.errors import KVIndexError
from kvindex.hashing import sequence_hashes
from kvindex.pages import PAGE_BLOCKS, pages_of
from kvindex.redis_index import RedisIndex
from kvindex.redis_worker import RedisWorker
from kvindex.types import StoredRun, WorkerInfo
from tests.index.test_differential import path_to, random_forest, random_tail

LONG_TTL = 600_000
CHAIN = sequence_hashes(list(range(16 * 100)), 16)  # 100 blocks: pages 0, 1, 2, 3
WORKERS = ("w0", "w1", "w2", "w3")
# Every chain of the random forests starts with these 40 blocks (a shared system prompt), so the
# forests' branches fall inside page 1 and their chains reach pages 1 and 2.
STEM = sequence_hashes(list(range(16 * 40)), 16, cache_salt="stem")
_examples = itertools.count()


def info(model: str, name: str) -> WorkerInfo:
    return WorkerInfo(name, model, f"http://{name}", 16)


def _listed(value: bytes | None) -> set[str]:
    return {g for g in (value or b"").decode().split(",") if g}


def _common(branch: str, page: str) -> int:
    n = 0
    while n < min(len(branch), len(page)) // 16 and branch[16 * n : 16 * n + 16] == page[16 * n : 16 * n + 16]:
        n += 1
    return n


def _stop_depth(fields: dict[bytes, bytes], hexes: str, me: str) -> int:
    """Where a gid that holds part of a page (``hexes``, the prompt's blocks there) stops in it:
    at the stem's end when the prompt follows the stem and the gid is not listed for the
    prompt's block after it; where the prompt leaves the stem; else along its own branches."""
    listed = (fields.get(f"h:{hexes[:16]}".encode()) or b",").count(b",") - 1  # as page_match.lua counts
    stem = fields.get(f"c:{hexes[:16]}".encode(), b"").decode() if listed >= 2 else ""
    if stem:
        s, k = len(stem) // 16, _common(stem, hexes)
        if k < s or k >= len(hexes) // 16:
            return k
        if me not in _listed(fields.get(f"k:{hexes[16 * s : 16 * s + 16]}".encode())):
            return s
    leaves = _listed(fields.get(f"g:{hexes[:16]}:{me}".encode()))
    branches = [fields.get(f"t:{leaf}".encode(), b"").decode() for leaf in leaves]
    return max((_common(b, hexes) for b in branches if b), default=0)


async def held_prefix(client: Redis, index: RedisIndex, model: str, gid: int, chain: list[int]) -> int:
    """The oracle: how many leading blocks of ``chain`` the holdings Redis lists for ``gid`` cover."""
    keys, me, depth, previous = index.keys(model), str(gid), 0, b"(no page before)"
    for page in pages_of(chain):
        fields = await client.hgetall(keys.segment(page.segment))
        hexes = "".join(f"{h:016x}" for h in chain[page.start : page.start + page.length])
        whole, holders = fields.get(f"e:{hexes[-16:]}".encode()), fields.get(f"h:{hexes[:16]}".encode())
        if me in _listed(whole):
            depth, previous = page.start + page.length, whole or b","
            continue
        # page_match.lua looks for a stop only where the page's holders are not listed as its
        # whole holders, and the previous page's whole holders are not this page's.
        if me in _listed(holders) and (holders or b",") != (whole or b",") and previous != (whole or b","):
            depth = page.start + _stop_depth(fields, hexes, me)
        return depth
    return depth


async def test_a_bogus_chain_start_elsewhere_moves_no_other_workers_match(redis_client, unique_name):
    """The issue's case: A holds 8 blocks, B 6, C indexes only block 7 with the chain-start flag."""
    index = RedisIndex(redis_client)
    a, b, c = [await index.register(info(unique_name, n), LONG_TTL) for n in "abc"]
    await a.store([StoredRun(None, tuple(CHAIN[:8]))])
    await b.store([StoredRun(None, tuple(CHAIN[:6]))])
    await c.store([StoredRun(None, (CHAIN[7],))])  # its encoder sends flag 'r' for block 7
    assert await index.match(unique_name, CHAIN) == {"a": 8, "b": 6, "c": 0}


async def test_a_deleted_segment_key_ends_every_match_there(redis_client, unique_name):
    index = RedisIndex(redis_client)
    a, b = [await index.register(info(unique_name, n), LONG_TTL) for n in "ab"]
    await a.store([StoredRun(None, tuple(CHAIN[:80]))])
    await b.store([StoredRun(None, tuple(CHAIN[:60]))])
    await redis_client.delete(index.keys(unique_name).segment(CHAIN[PAGE_BLOCKS]))  # page 1's key, evicted
    assert await index.match(unique_name, CHAIN) == {"a": 32, "b": 32}
    await b.reassert()  # b writes its holdings again: only b holds page 1 now
    assert await index.match(unique_name, CHAIN) == {"a": 32, "b": 60}


async def test_holdings_added_by_hand_credit_nobody_beyond_what_they_hold(redis_client, unique_name):
    index = RedisIndex(redis_client)
    a, b = [await index.register(info(unique_name, n), LONG_TTL) for n in "ab"]
    await a.store([StoredRun(None, tuple(CHAIN[:80]))])
    await b.store([StoredRun(None, tuple(CHAIN[:20]))])
    keys = index.keys(unique_name)
    page1 = keys.segment(CHAIN[PAGE_BLOCKS])
    # b listed by hand as holding page 1 whole: it holds only 20 blocks of page 0, so no credit.
    whole = f"e:{CHAIN[2 * PAGE_BLOCKS - 1]:016x}"
    await redis_client.hset(page1, whole, f",{a.gid},{b.gid},")
    assert await index.match(unique_name, CHAIN) == {"a": 80, "b": 20}
    # a stranger's gid in page 0's whole holders moves nobody.
    page0_whole = f"e:{CHAIN[PAGE_BLOCKS - 1]:016x}"
    await redis_client.hset(keys.segment(CHAIN[0]), page0_whole, f",{a.gid},{7 << 40},")
    assert await index.match(unique_name, CHAIN) == {"a": 80, "b": 20}
    # a listed no more as holding page 1 whole: it is still one of the page's holders, and the
    # page's stem (its one branch, all 32 blocks) says every holder holds that much, so its match
    # ends at the page's end (64), not beyond; b's does not move.
    await redis_client.hset(page1, whole, f",{b.gid},")
    assert await index.match(unique_name, CHAIN) == {"a": 64, "b": 20}
    # and no more among the page's holders: its match ends at page 0.
    await redis_client.hset(page1, f"h:{CHAIN[PAGE_BLOCKS]:016x}", ",")
    assert await index.match(unique_name, CHAIN) == {"a": 32, "b": 20}


corruption = st.one_of(
    st.tuples(st.just("delete"), st.integers(0, 29), st.just(0)),
    st.tuples(st.just("inject"), st.integers(0, 29), st.integers(0, len(WORKERS))),  # len: a stranger gid
    st.tuples(st.just("bogus_root"), st.integers(0, 29), st.integers(0, len(WORKERS) - 1)),
    st.tuples(st.just("store"), st.integers(0, 29), st.integers(0, len(WORKERS) - 1)),
    st.tuples(st.just("remove"), st.integers(0, 29), st.integers(0, len(WORKERS) - 1)),
)


async def damage(client: Redis, index: RedisIndex, model: str, handles, forest, nodes, op) -> None:
    kind, node, who = op
    page = pages_of(STEM + path_to(forest, nodes[node]))[-1]
    key = index.keys(model).segment(page.segment)
    if kind == "delete":
        await client.delete(key)
    elif kind == "inject":  # the gid listed as holding the page through this block, and in it
        gid = handles[who].gid if who < len(handles) else 7 << 40  # a gid nobody registered
        for field in (f"e:{nodes[node]:016x}", f"h:{page.first:016x}"):
            listed = (await client.hget(key, field) or b",").decode()
            await client.hset(key, field, listed + f"{gid},")
    else:
        try:
            if kind == "bogus_root":
                await handles[who].store([StoredRun(None, (nodes[node],))])
            elif kind == "store":
                path = STEM + path_to(forest, nodes[node])
                await handles[who].store([StoredRun(None, tuple(path))])
            else:
                await handles[who].remove([nodes[node]])
        except KVIndexError:
            pass  # Redis lacks what the mirror expected: the damage is noticed, as in production


async def check(redis_url: str, model: str, seed: int, holdings, ops) -> None:
    forest = random_forest(seed, 30)
    nodes = list(forest)
    client = Redis.from_url(redis_url)
    index = RedisIndex(client)
    try:
        handles: list[RedisWorker] = [await index.register(info(model, name), LONG_TTL) for name in WORKERS]
        for who, node in holdings:
            await handles[who].store([StoredRun(None, tuple(STEM + path_to(forest, nodes[node])))])
        for op in ops:
            await damage(client, index, model, handles, forest, nodes, op)
        for node in nodes:
            chain = STEM + path_to(forest, node) + random_tail(seed, 2)
            expected = {h.worker_id: await held_prefix(client, index, model, h.gid, chain) for h in handles}
            assert await index.match(model, chain) == expected, f"chain to {node:x}"
    finally:
        await client.aclose()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**32),
    holdings=st.lists(st.tuples(st.integers(0, len(WORKERS) - 1), st.integers(0, 29)), max_size=12),
    ops=st.lists(corruption, max_size=12),
)
def test_match_credits_each_gid_exactly_what_redis_holds_for_it(redis_server, unique_name, seed, holdings, ops):
    asyncio.run(check(redis_server.url, f"{unique_name}-{next(_examples)}", seed, holdings, ops))
