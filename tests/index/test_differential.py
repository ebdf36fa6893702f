"""Random operation sequences applied to the reference index and to RedisIndex on a real server
must give identical results at every step (store/remove/clear/re-register/deregister/expiry/gc/
match, and writes through a handle that a re-registration closed). Writes go through each
worker's handle, as the agent makes them."""

from __future__ import annotations

import asyncio
import itertools
import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis

from kvindex.errors import KVIndexError
from kvindex.interface import KVIndex, WorkerHandle
from kvindex.redis_index import RedisIndex
from kvindex.reference import ReferenceIndex
from kvindex.types import StoredRun, WorkerInfo

WORKERS = ("w0", "w1", "w2")
LONG_TTL = 600_000
_examples = itertools.count()


def random_forest(seed: int, size: int = 40) -> dict[int, int | None]:
    """Block hash -> parent hash: a few chains that branch, like prompts sharing prefixes."""
    rng = random.Random(seed)
    nodes: list[int] = []
    parent: dict[int, int | None] = {}
    for _ in range(size):
        block = rng.getrandbits(64)
        parent[block] = rng.choice(nodes) if nodes and rng.random() < 0.85 else None
        nodes.append(block)
    return parent


def path_to(parent: dict[int, int | None], block: int) -> list[int]:
    path: list[int] = []
    cur: int | None = block
    while cur is not None:
        path.append(cur)
        cur = parent[cur]
    return path[::-1]


def random_tail(seed: int, length: int) -> list[int]:
    """Hashes no forest contains (a separate random stream), to end a chain with unknown blocks."""
    rng = random.Random(f"tail-{seed}")
    return [rng.getrandbits(64) for _ in range(length)]


operation = st.one_of(
    st.tuples(st.just("store"), st.sampled_from(WORKERS), st.integers(0, 39), st.integers(1, 6)),
    st.tuples(st.just("remove"), st.sampled_from(WORKERS), st.lists(st.integers(0, 39), max_size=5), st.just(0)),
    st.tuples(st.just("clear"), st.sampled_from(WORKERS), st.just(0), st.just(0)),
    st.tuples(st.just("register"), st.sampled_from(WORKERS), st.just(0), st.just(0)),
    st.tuples(st.just("deregister"), st.sampled_from(WORKERS), st.just(0), st.just(0)),
    st.tuples(st.just("stale_store"), st.sampled_from(WORKERS), st.integers(0, 39), st.integers(1, 3)),
    st.tuples(st.just("expire"), st.sampled_from(WORKERS), st.just(0), st.just(0)),
    st.tuples(st.just("revive"), st.sampled_from(WORKERS), st.just(0), st.just(0)),
    # A budget of at least one per worker: gc retires min(budget, 1000) dead workers per call
    # (tests/index/test_script_bounds.py), and which of two equally old ones goes first depends on
    # Redis's random gids, which the reference does not draw.
    st.tuples(st.just("gc"), st.just(""), st.integers(len(WORKERS), 50), st.just(0)),
    st.tuples(st.just("match"), st.just(""), st.integers(0, 39), st.integers(0, 3)),
)


async def outcome(call):
    try:
        return ("ok", await call)
    except KVIndexError:
        return ("rejected", None)


class Backend:
    """One index and its workers' handles: the current one, and the one before (closed)."""

    def __init__(self, index: KVIndex) -> None:
        self.index = index
        self.handles: dict[str, WorkerHandle] = {}
        self.previous: dict[str, WorkerHandle] = {}

    async def register(self, model: str, worker_id: str) -> tuple[str, int | None]:
        status, handle = await outcome(
            self.index.register(WorkerInfo(worker_id, model, f"http://{worker_id}", 16), LONG_TTL)
        )
        if handle is None:
            return status, None
        if worker_id in self.handles:
            self.previous[worker_id] = self.handles[worker_id]
        self.handles[worker_id] = handle
        assert handle.active
        return status, handle.registration.epoch  # gids are backend-specific


async def apply(backend: Backend, model, forest, nodes, op):
    kind, worker_id, arg, extra = op
    handle = backend.handles.get(worker_id)
    if kind in ("store", "stale_store"):
        if kind == "stale_store":
            handle = backend.previous.get(worker_id)
            if handle is None:
                return ("no previous handle", None)
        path = path_to(forest, nodes[arg])[-extra:]
        return await outcome(handle.store([StoredRun(forest[path[0]], tuple(path))]))
    if kind == "remove":
        return await outcome(handle.remove([nodes[i] for i in arg]))
    if kind == "clear":
        return await outcome(handle.clear())
    if kind == "deregister":
        result = await outcome(handle.deregister())
        return (*result, handle.active)
    if kind == "register":
        return await backend.register(model, worker_id)
    if kind in ("expire", "revive"):
        return await outcome(handle.heartbeat(0 if kind == "expire" else LONG_TTL))
    if kind == "gc":
        result = await backend.index.gc(model, budget=arg, grace_ms=0)
        return ("ok", result.workers_retired)
    chain = path_to(forest, nodes[arg]) + random_tail(arg, extra)
    return ("ok", await backend.index.match(model, chain))


async def compare(redis_url: str, model: str, seed: int, ops) -> None:
    forest = random_forest(seed)
    nodes = list(forest)
    client = Redis.from_url(redis_url)
    reference, redis = Backend(ReferenceIndex()), Backend(RedisIndex(client))
    try:
        for worker_id in WORKERS:
            for backend in (reference, redis):
                await backend.register(model, worker_id)
        for step, op in enumerate(ops):
            expected = await apply(reference, model, forest, nodes, op)
            actual = await apply(redis, model, forest, nodes, op)
            assert actual == expected, f"step {step} {op}: redis {actual} != reference {expected}"
            full = path_to(forest, nodes[step % len(nodes)])
            assert await redis.index.match(model, full) == await reference.index.match(model, full), f"after {step}"
        assert (await redis.index.stats(model)).entries == (await reference.index.stats(model)).entries
        for block in nodes:
            chain = path_to(forest, block)
            assert await redis.index.owners(model, block, chain) == await reference.index.owners(model, block)
    finally:
        await client.aclose()


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32), ops=st.lists(operation, max_size=80))
def test_redis_index_agrees_with_the_reference(redis_server, unique_name, seed, ops):
    asyncio.run(compare(redis_server.url, f"{unique_name}-{next(_examples)}", seed, ops))
