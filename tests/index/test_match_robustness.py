"""A match is right for every worker even when the block keys are damaged: evicted or deleted
keys, members added by hand for other gids, stores with a bogus chain-start flag. A gid is
credited with depth d only if Redis holds it in every block key 0..d-1 (the oracle below reads
exactly that), so no damage to one worker's entries can move another worker's match."""

from __future__ import annotations

import asyncio
import itertools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis

from kvindex.errors import KVIndexError
from kvindex.hashing import sequence_hashes
from kvindex.redis_index import RedisIndex
from kvindex.redis_worker import RedisWorker
from kvindex.types import StoredRun, WorkerInfo
from tests.index.test_differential import path_to, random_forest, random_tail

LONG_TTL = 600_000
CHAIN = sequence_hashes(list(range(160)), 16)  # 10 blocks
WORKERS = ("w0", "w1", "w2", "w3")
_examples = itertools.count()


def info(model: str, name: str) -> WorkerInfo:
    return WorkerInfo(name, model, f"http://{name}", 16)


async def held_prefix(client: Redis, index: RedisIndex, model: str, gid: int, chain: list[int]) -> int:
    """The oracle: how many leading blocks of ``chain`` list ``gid`` as a member in Redis."""
    async with client.pipeline(transaction=False) as pipe:
        for block in chain:
            pipe.sismember(index.keys(model).bucket_of_chain(chain[0]).block(block), str(gid))
        present = await pipe.execute()
    return next((depth for depth, held in enumerate(present) if not held), len(chain))


async def test_a_bogus_chain_start_elsewhere_moves_no_other_workers_match(redis_client, unique_name):
    """The issue's case: A holds 8 blocks, B 6, C indexes only block 7 with the chain-start flag."""
    index = RedisIndex(redis_client)
    a, b, c = [await index.register(info(unique_name, n), LONG_TTL) for n in "abc"]
    await a.store([StoredRun(None, tuple(CHAIN[:8]))])
    await b.store([StoredRun(None, tuple(CHAIN[:6]))])
    await c.store([StoredRun(None, (CHAIN[7],))])  # its encoder sends flag 'r' for block 7
    assert await index.match(unique_name, CHAIN) == {"a": 8, "b": 6, "c": 0}


async def test_a_deleted_block_key_ends_every_match_there(redis_client, unique_name):
    index = RedisIndex(redis_client)
    a, b = [await index.register(info(unique_name, n), LONG_TTL) for n in "ab"]
    await a.store([StoredRun(None, tuple(CHAIN[:8]))])
    await b.store([StoredRun(None, tuple(CHAIN[:6]))])
    await redis_client.delete(index.keys(unique_name).bucket_of_chain(CHAIN[0]).block(CHAIN[3]))  # an eviction
    assert await index.match(unique_name, CHAIN) == {"a": 3, "b": 3}
    await b.reassert()  # b writes its blocks again: only b holds block 3 now
    assert await index.match(unique_name, CHAIN) == {"a": 3, "b": 6}


async def test_members_added_by_hand_credit_nobody_beyond_what_they_hold(redis_client, unique_name):
    index = RedisIndex(redis_client)
    a, b = [await index.register(info(unique_name, n), LONG_TTL) for n in "ab"]
    await a.store([StoredRun(None, tuple(CHAIN[:8]))])
    await b.store([StoredRun(None, tuple(CHAIN[:4]))])
    keys = index.keys(unique_name).bucket_of_chain(CHAIN[0])
    # Block 5 loses its key and comes back by hand with b alone: same owner count as a's chain.
    await redis_client.delete(keys.block(CHAIN[5]))
    await redis_client.sadd(keys.block(CHAIN[5]), str(b.gid))
    assert await index.match(unique_name, CHAIN) == {"a": 5, "b": 4}
    for depth in (4, 6, 7):
        await redis_client.sadd(keys.block(CHAIN[depth]), str(b.gid))
    assert await index.match(unique_name, CHAIN) == {"a": 5, "b": 8}


corruption = st.one_of(
    st.tuples(st.just("delete"), st.integers(0, 29), st.just(0)),
    st.tuples(st.just("inject"), st.integers(0, 29), st.integers(0, len(WORKERS))),  # len: a stranger gid
    st.tuples(st.just("bogus_root"), st.integers(0, 29), st.integers(0, len(WORKERS) - 1)),
    st.tuples(st.just("store"), st.integers(0, 29), st.integers(0, len(WORKERS) - 1)),
    st.tuples(st.just("remove"), st.integers(0, 29), st.integers(0, len(WORKERS) - 1)),
)


async def damage(client: Redis, index: RedisIndex, model: str, handles, forest, nodes, op) -> None:
    kind, node, who = op
    key = index.keys(model).bucket_of_chain(path_to(forest, nodes[node])[0]).block(nodes[node])
    if kind == "delete":
        await client.delete(key)
    elif kind == "inject":
        gid = handles[who].gid if who < len(handles) else 7 << 40  # a gid nobody registered
        await client.sadd(key, str(gid))
    else:
        try:
            if kind == "bogus_root":
                await handles[who].store([StoredRun(None, (nodes[node],))])
            elif kind == "store":
                path = path_to(forest, nodes[node])
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
            await handles[who].store([StoredRun(None, tuple(path_to(forest, nodes[node])))])
        for op in ops:
            await damage(client, index, model, handles, forest, nodes, op)
        for node in nodes:
            chain = path_to(forest, node) + random_tail(seed, 2)
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
