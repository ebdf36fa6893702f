"""A hybrid model's window-group blocks in the index (kvindex/groups.py), on every backend: kept
as one-block chains that the worker holds, read back per block by ``group_holders``, never met by
a match of a prompt's chain; the worker's record says its groups."""

from kvindex.groups import FULL_KINDS, GroupSpec, format_groups, group_block_hash, parse_groups
from kvindex.hashing import sequence_hashes
from kvindex.types import RemovedBlocks, StoredRun, WorkerInfo

LONG_TTL = 60_000
CHAIN = sequence_hashes(list(range(64)), 4)  # 16 blocks
SLIDING = 0


def names(positions: range | list[int]) -> list[int]:
    return [group_block_hash(CHAIN[p], SLIDING) for p in positions]


def held(blocks: list[int]) -> list[StoredRun]:
    return [StoredRun(None, (block,)) for block in blocks]


async def test_group_blocks_read_back_per_block_and_apart_from_the_chains(index, unique_name):
    for name in ("a", "b"):
        await index.register(WorkerInfo(name, unique_name, f"http://{name}", 4), LONG_TTL)
    a, b = index.handle(unique_name, "a"), index.handle(unique_name, "b")
    await a.apply([StoredRun(None, tuple(CHAIN)), *held(names([13, 14, 15]))])
    await b.apply(held(names([6, 7, 14])))
    holders = await index.group_holders(unique_name, names(range(16)))
    assert [sorted(h) for h in holders] == [[]] * 6 + [["b"], ["b"]] + [[]] * 5 + [["a"], ["a", "b"], ["a"]]
    # the chains' match never meets them (b holds no chain)
    assert await index.match(unique_name, CHAIN) == {"a": 16, "b": 0}
    await a.remove(names([14]))
    assert [sorted(h) for h in await index.group_holders(unique_name, names([13, 14]))] == [["a"], ["b"]]
    assert await index.group_holders(unique_name, []) == []


async def test_a_removed_or_cleared_worker_holds_no_group_block(index, unique_name):
    for name in ("a", "b"):
        await index.register(WorkerInfo(name, unique_name, f"http://{name}", 4), LONG_TTL)
    await index.handle(unique_name, "a").apply(held(names([3])))
    await index.handle(unique_name, "b").apply(held(names([3])))
    await index.handle(unique_name, "a").clear()
    await index.handle(unique_name, "b").apply([RemovedBlocks(tuple(names([3])))])
    assert await index.group_holders(unique_name, names([3])) == [set()]


async def test_the_record_says_the_workers_groups(index, unique_name):
    await index.register(WorkerInfo("a", unique_name, "http://a", 4, adapters=("x",)), LONG_TTL)
    groups = format_groups([GroupSpec(1, "full_attention", 4), GroupSpec(0, "sliding_window", 4, 8)])
    await index.handle(unique_name, "a").set_kv_groups(groups)
    (record,) = await index.workers(unique_name)
    assert record.adapters == ("x",)  # kept beside them
    parsed = parse_groups(record.kv_groups)
    assert [(g.index, g.kind in FULL_KINDS, g.window) for g in parsed] == [(0, False, 8), (1, True, None)]
