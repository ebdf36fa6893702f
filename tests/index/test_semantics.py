"""Behaviour every index backend must have (runs against the reference and each Redis kind)."""

import pytest

from kvindex.errors import BlockSizeMismatchError, KVIndexError, NotRegisteredError
from kvindex.hashing import sequence_hashes
from kvindex.types import HeartbeatStatus, RemovedBlocks, StoredRun, WorkerInfo, WorkerLoad
from tests.support import wait_until

LONG_TTL = 60_000


def worker(model: str, name: str, block_size: int = 4) -> WorkerInfo:
    return WorkerInfo(name, model, f"http://{name}:8000", block_size)


def run(chain: list[int], start: int, stop: int) -> StoredRun:
    return StoredRun(chain[start - 1] if start else None, tuple(chain[start:stop]))


CHAIN = sequence_hashes(list(range(64)), 4)  # 16 blocks


async def test_match_counts_leading_blocks_per_alive_worker(index, unique_name):
    for name in ("a", "b", "c"):
        await index.register(worker(unique_name, name), LONG_TTL)
    await index.handle(unique_name, "a").store([run(CHAIN, 0, 10)])
    await index.handle(unique_name, "b").store([run(CHAIN, 0, 3)])
    assert await index.match(unique_name, CHAIN) == {"a": 10, "b": 3, "c": 0}
    assert await index.match(unique_name, CHAIN[:2]) == {"a": 2, "b": 2, "c": 0}
    assert await index.match(unique_name, []) == {"a": 0, "b": 0, "c": 0}
    other = sequence_hashes(list(range(100, 164)), 4)
    assert await index.match(unique_name, other) == {"a": 0, "b": 0, "c": 0}


async def test_a_hole_in_the_chain_ends_the_match(index, unique_name):
    await index.register(worker(unique_name, "a"), LONG_TTL)
    result = await index.handle(unique_name, "a").store([run(CHAIN, 0, 4), run(CHAIN, 5, 9)])
    assert (result.applied, result.skipped) == (4, 4)
    assert await index.match(unique_name, CHAIN) == {"a": 4}
    await index.handle(unique_name, "a").store([run(CHAIN, 4, 5)])  # the missing block arrives
    assert await index.match(unique_name, CHAIN) == {"a": 9}
    await index.handle(unique_name, "a").remove([CHAIN[2]])
    assert await index.match(unique_name, CHAIN) == {"a": 2}
    assert await index.owners(unique_name, CHAIN[6], CHAIN[:7]) == {}


async def test_duplicate_stores_are_reference_counted(index, unique_name):
    await index.register(worker(unique_name, "a"), LONG_TTL)
    await index.handle(unique_name, "a").store([run(CHAIN, 0, 4)])
    await index.handle(unique_name, "a").store([run(CHAIN, 3, 4)])  # vLLM's second copy of the last block
    assert await index.owners(unique_name, CHAIN[3], CHAIN[:4]) == {"a": 1}  # held; copies are the writer's
    await index.handle(unique_name, "a").remove([CHAIN[3]])
    assert await index.match(unique_name, CHAIN) == {"a": 4}
    await index.handle(unique_name, "a").remove([CHAIN[3]])
    assert await index.match(unique_name, CHAIN) == {"a": 3}
    result = await index.handle(unique_name, "a").remove([CHAIN[3]])
    assert (result.applied, result.missing) == (0, 1)


async def test_clear_and_deregister_drop_everything_at_once(index, unique_name):
    await index.register(worker(unique_name, "a"), LONG_TTL)
    await index.register(worker(unique_name, "b"), LONG_TTL)
    for name in ("a", "b"):
        await index.handle(unique_name, name).store([run(CHAIN, 0, 8)])
    await index.handle(unique_name, "a").clear()
    assert await index.match(unique_name, CHAIN) == {"a": 0, "b": 8}
    await index.handle(unique_name, "a").store([run(CHAIN, 0, 2)])
    assert await index.match(unique_name, CHAIN) == {"a": 2, "b": 8}
    await index.handle(unique_name, "b").deregister()
    assert await index.match(unique_name, CHAIN) == {"a": 2}
    with pytest.raises(NotRegisteredError):
        await index.handle(unique_name, "b").store([run(CHAIN, 0, 1)])


async def test_dead_workers_never_count(index, unique_name):
    await index.register(worker(unique_name, "a"), LONG_TTL)
    await index.register(worker(unique_name, "b"), LONG_TTL)
    for name in ("a", "b"):
        await index.handle(unique_name, name).store([run(CHAIN, 0, 8)])
    assert await index.handle(unique_name, "b").heartbeat(0) == HeartbeatStatus.OK  # deadline = now
    assert await index.match(unique_name, CHAIN) == {"a": 8}
    assert await index.owners(unique_name, CHAIN[0], CHAIN[:1]) == {"a": 1}
    assert await index.handle(unique_name, "b").heartbeat(LONG_TTL) == HeartbeatStatus.OK
    assert await index.match(unique_name, CHAIN) == {"a": 8, "b": 8}


async def test_heartbeat_ttl_expires_in_real_time(index, unique_name):
    await index.register(worker(unique_name, "a"), 1_000)
    await index.handle(unique_name, "a").store([run(CHAIN, 0, 4)])
    assert await index.match(unique_name, CHAIN) == {"a": 4}

    async def expired() -> bool:
        return await index.match(unique_name, CHAIN) == {}

    assert await wait_until(expired, 5) < 4.0
    assert [w.alive for w in await index.workers(unique_name)] == [False]


async def test_gc_forgets_long_dead_workers(index, unique_name):
    await index.register(worker(unique_name, "a"), LONG_TTL)
    await index.register(worker(unique_name, "b"), LONG_TTL)
    await index.handle(unique_name, "b").store([run(CHAIN, 0, 8)])
    await index.handle(unique_name, "b").heartbeat(0)
    result = await index.gc(unique_name, grace_ms=0)
    assert result.workers_retired == 1
    assert [w.worker_id for w in await index.workers(unique_name)] == ["a"]
    assert await index.handle(unique_name, "b").heartbeat(LONG_TTL) == HeartbeatStatus.MISSING
    with pytest.raises(KVIndexError):
        await index.handle(unique_name, "b").store([run(CHAIN, 0, 1)])
    stats = await index.stats(unique_name)
    assert (stats.workers, stats.alive_workers, stats.entries, stats.pages) == (1, 1, 0, 0)


async def test_reregistering_starts_empty(index, unique_name):
    first = (await index.register(worker(unique_name, "a"), LONG_TTL)).registration
    await index.handle(unique_name, "a").store([run(CHAIN, 0, 8)])
    second = (await index.register(worker(unique_name, "a"), LONG_TTL)).registration
    assert second.epoch == first.epoch + 1 and second.gid != first.gid
    assert await index.match(unique_name, CHAIN) == {"a": 0}


async def test_the_handle_register_returns_writes_its_worker(index, unique_name):
    a = await index.register(worker(unique_name, "a"), LONG_TTL)
    assert a.active and a.info == worker(unique_name, "a")
    result = await a.apply([run(CHAIN, 0, 6), RemovedBlocks((CHAIN[5],))])
    assert (result.applied, result.skipped, result.missing) == (7, 0, 0)
    await a.store([run(CHAIN, 5, 8)])
    await a.remove([CHAIN[7]])
    assert await index.match(unique_name, CHAIN) == {"a": 7}
    assert await a.report_load(WorkerLoad(2, 0, 0.5)) == HeartbeatStatus.OK
    gid = a.registration.gid
    await a.clear()
    assert a.registration.gid != gid and a.registration.epoch == 1  # a fresh generation, same registration
    assert await index.match(unique_name, CHAIN) == {"a": 0}
    assert await a.heartbeat() == HeartbeatStatus.OK  # the TTL it registered with
    assert [w.ttl_ms for w in await index.workers(unique_name)] == [LONG_TTL]
    await a.deregister()
    assert not a.active and await index.match(unique_name, CHAIN) == {}
    for write in (a.store([run(CHAIN, 0, 1)]), a.clear(), a.heartbeat(), a.deregister()):
        with pytest.raises(NotRegisteredError):
            await write


async def test_registering_again_closes_the_previous_handle(index, unique_name):
    first = await index.register(worker(unique_name, "a"), LONG_TTL)
    await first.store([run(CHAIN, 0, 4)])
    second = await index.register(worker(unique_name, "a"), LONG_TTL)
    assert not first.active and second.active
    with pytest.raises(NotRegisteredError):
        await first.store([run(CHAIN, 0, 8)])
    await second.store([run(CHAIN, 0, 2)])
    assert await index.match(unique_name, CHAIN) == {"a": 2}
    await index.handle(unique_name, "a").store([run(CHAIN, 2, 3)])  # the handle found by id is the current one
    assert await index.match(unique_name, CHAIN) == {"a": 3}
    await index.handle(unique_name, "a").deregister()
    assert not second.active


async def test_a_worker_gc_forgot_answers_missing_through_its_handle(index, unique_name):
    a = await index.register(worker(unique_name, "a"), LONG_TTL)
    await a.heartbeat(0)
    assert (await index.gc(unique_name, grace_ms=0)).workers_retired == 1
    assert a.active  # the client was not told
    assert await a.heartbeat(LONG_TTL) == HeartbeatStatus.MISSING
    with pytest.raises(KVIndexError):
        await a.store([run(CHAIN, 0, 1)])
    assert (await index.register(worker(unique_name, "a"), LONG_TTL)).active and not a.active


async def test_one_block_size_per_model(index, unique_name):
    await index.register(worker(unique_name, "a", 16), LONG_TTL)
    with pytest.raises(BlockSizeMismatchError, match="block_size 16"):
        await index.register(worker(unique_name, "b", 32), LONG_TTL)
    assert await index.block_size(unique_name) == 16
    await index.handle(unique_name, "a").heartbeat(0)  # once no other worker is alive, it may change
    await index.register(worker(unique_name, "b", 32), LONG_TTL)
    assert await index.block_size(unique_name) == 32


async def test_models_are_separate_namespaces(index, unique_name):
    other = unique_name + "-other"
    await index.register(worker(unique_name, "a"), LONG_TTL)
    await index.register(worker(other, "a"), LONG_TTL)
    await index.handle(unique_name, "a").store([run(CHAIN, 0, 5)])
    assert await index.match(other, CHAIN) == {"a": 0}
    assert {unique_name, other} <= set(await index.models())
    stats = await index.stats(unique_name)
    assert (stats.block_size, stats.workers, stats.entries, stats.block_keys, stats.pages) == (4, 1, 5, 0, 1)


async def test_apply_takes_changes_in_their_order(index, unique_name):
    await index.register(worker(unique_name, "a"), LONG_TTL)
    # store then remove the tail in one call: gone; remove then store again: present.
    result = await index.handle(unique_name, "a").apply(
        [run(CHAIN, 0, 6), RemovedBlocks((CHAIN[5], CHAIN[4])), run(CHAIN, 4, 5)]
    )
    assert (result.applied, result.skipped, result.missing) == (9, 0, 0)
    assert await index.match(unique_name, CHAIN) == {"a": 5}
    result = await index.handle(unique_name, "a").apply([RemovedBlocks((CHAIN[9],)), RemovedBlocks((CHAIN[2],))])
    assert (result.applied, result.missing) == (1, 1)
    assert await index.match(unique_name, CHAIN) == {"a": 2}
    await index.handle(unique_name, "a").apply([run(CHAIN, 2, 3)])
    assert await index.match(unique_name, CHAIN) == {"a": 5}


async def test_apply_counts_copies_like_store_and_remove(index, unique_name):
    await index.register(worker(unique_name, "a"), LONG_TTL)
    await index.handle(unique_name, "a").apply([run(CHAIN, 0, 3), run(CHAIN, 2, 3), RemovedBlocks((CHAIN[2],))])
    assert await index.match(unique_name, CHAIN) == {"a": 3}
    assert await index.owners(unique_name, CHAIN[2], CHAIN[:3]) == {"a": 1}


async def test_reported_load_is_shown_with_the_worker(index, unique_name):
    await index.register(worker(unique_name, "a"), LONG_TTL)
    await index.register(worker(unique_name, "b"), LONG_TTL)
    status = await index.handle(unique_name, "a").report_load(WorkerLoad(running=3, waiting=1, kv_usage=0.25))
    assert status == HeartbeatStatus.OK
    records = {r.worker_id: r for r in await index.workers(unique_name)}
    assert records["a"].load == WorkerLoad(3, 1, 0.25)
    assert records["a"].load_age_ms is not None and 0 <= records["a"].load_age_ms < 5_000
    assert records["b"].load is None and records["b"].load_age_ms is None
    await index.handle(unique_name, "b").deregister()
    with pytest.raises(NotRegisteredError):
        await index.handle(unique_name, "b").report_load(WorkerLoad(0, 0, 0.0))


@pytest.mark.parametrize("ttl", [float("inf"), float("nan"), -1, 1.5, 86_400_001])
async def test_a_heartbeat_ttl_that_is_not_a_sane_integer_is_refused(index, unique_name, ttl):
    """Lua's tonumber reads 'inf' and 'nan': an infinite TTL kept a dead worker alive forever."""
    await index.register(WorkerInfo("w", unique_name, "http://127.0.0.1:9", 4), ttl_ms=LONG_TTL)
    with pytest.raises(KVIndexError, match="ttl_ms must be an integer from 0 to 86400000"):
        await index.handle(unique_name, "w").heartbeat(ttl)  # type: ignore[arg-type]
    with pytest.raises(KVIndexError, match="ttl_ms must be an integer"):
        await index.register(WorkerInfo("w2", unique_name, "http://127.0.0.1:9", 4), ttl_ms=ttl)  # type: ignore[arg-type]


async def test_a_workers_lora_adapters_are_registered_and_follow_its_engine(index, unique_name):
    """A worker announces the adapters its engine serves; later loads and unloads replace the list,
    and a new registration starts from what it announces."""
    info = WorkerInfo("a", unique_name, "http://a:8000", 4, adapters=("sql-lora", "chat-lora", "sql-lora"))
    handle = await index.register(info, LONG_TTL)
    await index.register(worker(unique_name, "b"), LONG_TTL)

    async def adapters() -> dict[str, tuple[str, ...]]:
        return {record.worker_id: record.adapters for record in await index.workers(unique_name)}

    assert await adapters() == {"a": ("chat-lora", "sql-lora"), "b": ()}
    assert await handle.set_adapters(["sql-lora", "new-lora"]) == HeartbeatStatus.OK
    assert await adapters() == {"a": ("new-lora", "sql-lora"), "b": ()}
    assert await index.handle(unique_name, "a").set_adapters([]) == HeartbeatStatus.OK
    assert (await adapters())["a"] == ()
    again = await index.register(info, LONG_TTL)
    assert (await adapters())["a"] == ("chat-lora", "sql-lora")
    with pytest.raises(NotRegisteredError):
        await handle.set_adapters(["stale"])  # the previous registration's handle is closed
    await again.deregister()
    assert "a" not in await adapters()


async def test_an_adapter_name_must_be_one_non_empty_line(index, unique_name):
    handle = await index.register(worker(unique_name, "a"), LONG_TTL)
    for bad in (["two\nlines"], [""]):
        with pytest.raises(ValueError, match="adapter name"):
            await handle.set_adapters(bad)


async def test_a_workers_role_is_registered_and_read_back(index, unique_name):
    """A prefill/decode fleet's roles (kvindex/roles.py): what a worker registers is what every
    reader sees; a worker that names none is a complete engine (both)."""
    await index.register(WorkerInfo("p", unique_name, "http://p", 4, role="prefill"), LONG_TTL)
    await index.register(WorkerInfo("d", unique_name, "http://d", 4, role="decode"), LONG_TTL)
    await index.register(worker(unique_name, "b"), LONG_TTL)
    roles = {record.worker_id: record.role for record in await index.workers(unique_name)}
    assert roles == {"p": "prefill", "d": "decode", "b": "both"}
    await index.register(WorkerInfo("p", unique_name, "http://p", 4), LONG_TTL)  # re-registered unsplit
    assert {r.worker_id: r.role for r in await index.workers(unique_name)}["p"] == "both"
    with pytest.raises(ValueError, match="role is one of both, prefill, decode, got 'boss'"):
        WorkerInfo("x", unique_name, "http://x", 4, role="boss")


async def test_a_workers_context_length_is_registered_and_read_back(index, unique_name):
    """The engine's max_model_len, where its agent learned it (routers refuse prompts longer than
    it): what a worker registers every reader sees; 0 is unknown (None), as records before it."""
    await index.register(WorkerInfo("a", unique_name, "http://a", 4, max_model_len=4096), LONG_TTL)
    await index.register(worker(unique_name, "b"), LONG_TTL)
    lengths = {record.worker_id: record.max_model_len for record in await index.workers(unique_name)}
    assert lengths == {"a": 4096, "b": None}
    with pytest.raises(ValueError, match=r"max_model_len is 0 \(unknown\) or more, got -1"):
        WorkerInfo("x", unique_name, "http://x", 4, max_model_len=-1)
