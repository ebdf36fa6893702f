"""The page layout's scripts (page_apply.lua, page_match.lua; kvindex.pages) on a real server:
holdings written page by page and matched exactly, whatever the prompts share."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis

from kvindex import calls as lua
from kvindex.calls import BucketPages
from kvindex.keys import KeySchema
from kvindex.pages import PAGE_BLOCKS, combine, holding_changes, page_holdings, pages_of, segments
from kvindex.scripts import Scripts

KEYS = KeySchema("pt").for_model("m")


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class PageWriter:
    """One gid's writes with page_apply.lua's op continuity per bucket: all buckets in one call
    (a single server) or one call a bucket (a cluster)."""

    def __init__(self, scripts: Scripts, gid: int, one_call: bool = True) -> None:
        self.scripts, self.gid, self.one_call = scripts, gid, one_call
        self.ops: dict[str, int] = {}
        self.holdings: dict = {}

    async def hold(self, chains: list[list[int]]) -> None:
        after = page_holdings(chains)
        by_bucket: dict[str, list] = {}
        for change in holding_changes(self.holdings, after):
            by_bucket.setdefault(KEYS.bucket_of_segment(change.segment).base, []).append(change)
        parts = []
        for base, changes in by_bucket.items():
            previous = self.ops.get(base, 0)
            parts.append(BucketPages(KEYS.bucket_of_segment(changes[0].segment), previous, previous + 1, 0, changes))
            self.ops[base] = previous + 1
        groups = [parts] if self.one_call else [[part] for part in parts]
        for group in groups:
            if group:
                replies = await self.scripts.run(lua.page_apply(self.gid, group))
                assert [r[0] for r in replies] == [b"ok"] * len(group)
        self.holdings = after


def random_forest(rng: random.Random, roots: int, chains: int, longest: int) -> list[list[int]]:
    """Chains that share prefixes the way prompts do: each new one branches off an earlier one
    at a random depth (or starts a new root) and goes on with fresh blocks."""
    made: list[list[int]] = []
    for i in range(chains):
        if i < roots:
            base: list[int] = []
        else:
            other = rng.choice(made)
            base = other[: rng.randint(1, len(other))]
        length = rng.randint(len(base) + 1, max(longest, len(base) + 1))
        made.append(base + [rng.getrandbits(64) for _ in range(length - len(base))])
    return made


async def match_both_ways(scripts: Scripts, query: list[int]) -> tuple[dict[int, int], dict[int, int]]:
    """The match as one chained call (a single server), and as one call per segment key, read
    apart and combined (a cluster)."""
    pages = pages_of(query)
    chained = combine(pages, await scripts.run(lua.page_match(KEYS, pages, query, chained=True)))
    apart, at = [], 0
    for _, count in segments(pages):
        apart += await scripts.run(lua.page_match(KEYS, pages[at : at + count], query, chained=False))
        at += count
    return chained, combine(pages, apart)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32), gids=st.integers(1, 5), longest=st.sampled_from([5, 40, 100, 200]))
async def test_a_match_credits_each_gid_its_longest_held_prefix(redis_client: Redis, seed, gids, longest):
    await redis_client.flushall()
    rng = random.Random(seed)
    scripts = Scripts(redis_client)
    forest = random_forest(rng, roots=2, chains=8, longest=longest)
    held: dict[int, list[list[int]]] = {}
    for g in range(1, gids + 1):
        gid = 2**40 + g
        writer = PageWriter(scripts, gid, one_call=rng.random() < 0.5)
        chains = [c[: rng.randint(1, len(c))] for c in rng.sample(forest, rng.randint(1, 4))]
        await writer.hold(chains)
        if rng.random() < 0.5:  # evictions: some chains cut shorter, some dropped, one added
            chains = [c[: rng.randint(1, len(c))] for c in chains[1:]] + [rng.choice(forest)[:longest]]
            await writer.hold(chains)
        held[gid] = chains
    for query in [*forest, *([*c[: rng.randint(1, len(c))], rng.getrandbits(64)] for c in forest)]:
        expected = {gid: max(common_prefix(query, c) for c in chains) for gid, chains in held.items()}
        expected = {gid: d for gid, d in expected.items() if d}
        chained, apart = await match_both_ways(scripts, query)
        assert chained == expected
        assert apart == expected


async def test_a_gid_that_lets_go_of_everything_leaves_no_page_behind(redis_client: Redis):
    await redis_client.flushall()
    scripts = Scripts(redis_client)
    rng = random.Random(1)
    chain = [rng.getrandbits(64) for _ in range(3 * PAGE_BLOCKS + 5)]
    writer = PageWriter(scripts, 12345)
    await writer.hold([chain, [*chain[:40], 7, 8]])
    # pages 0, 1, 2-3: three segment keys, one page of the branch in segment 1
    assert len(await redis_client.keys(KEYS.bucket_base("*") + "s:*")) == 3
    assert await match_both_ways(scripts, chain) == ({12345: len(chain)}, {12345: len(chain)})
    await writer.hold([])
    assert await redis_client.keys(KEYS.bucket_base("*") + "s:*") == []
    assert await redis_client.keys(KEYS.bucket_base("*") + "g:*") != []  # op continuity stays
    assert await match_both_ways(scripts, chain) == ({}, {})


async def test_a_page_shows_its_holdings_as_text(redis_client: Redis):
    await redis_client.flushall()
    scripts = Scripts(redis_client)
    writer = PageWriter(scripts, 99)
    await writer.hold([[1, 2, 3]])
    page = await redis_client.hgetall(KEYS.segment(1))
    first, leaf = f"{1:016x}", f"{3:016x}"
    assert page == {
        f"h:{first}".encode(): b",99,",
        f"g:{first}:99".encode(): f",{leaf},".encode(),
        f"e:{leaf}".encode(): b",99,",
        f"t:{leaf}".encode(): f"{first}{2:016x}{leaf}".encode(),
    }  # one holder: no stem
    log = await redis_client.get(KEYS.bucket_of_segment(1).page_log(99))
    assert log == f"{first}{first}".encode()


async def test_a_replayed_or_out_of_order_write_changes_nothing(redis_client: Redis):
    await redis_client.flushall()
    scripts = Scripts(redis_client)
    changes = holding_changes({}, page_holdings([[5, 6]]))
    bucket = KEYS.bucket_of_segment(5)
    first = lua.page_apply(3, [BucketPages(bucket, 0, 1, 2, changes)])
    assert (await scripts.run(first))[0][0] == b"ok"
    assert (await scripts.run(first))[0][0] == b"dup"
    assert (await scripts.run(lua.page_apply(3, [BucketPages(bucket, 5, 6, 0, changes)])))[0][0] == b"lost"
    assert await redis_client.hget(bucket.state(3), "n") == b"2"


LEAF = "00000000000000aa"
PAGE = ["1", LEAF, "0"]  # key place, first block, leaves held before


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["3", "1", "0", "1", "0", "1", "1", *PAGE, "1", "0", LEAF, "00000000000000bb"], "branch"),
        (["3", "1", "0", "1", "0", "1", "1", *PAGE, "1"], "counts"),
        (["3", "1", "0", "1", "0", "1", "1", *PAGE, "0", "0", "extra"], "malformed"),
        (["x", "1", "0", "1", "0", "1", "1", *PAGE, "0", "0"], "decimal gid"),
        (["3", "1", "1", "1", "0", "1", "1", *PAGE, "0", "0"], "op > previous"),
        (["3", "1", "0", "1", "0", "1", "1", "2", LEAF, "0", "0"], "key place"),
    ],
)
async def test_page_apply_refuses_malformed_arguments_with_a_message(redis_client: Redis, args, message):
    bucket = KEYS.bucket_of_segment(0)
    call = lua.PAGE_APPLY.call([bucket.state(3), bucket.page_log(3), bucket.segment(0)], args)
    with pytest.raises(Exception, match=message):
        await Scripts(redis_client).run(call)


async def test_a_shared_stem_inside_a_page_costs_a_match_one_look_not_one_per_gid(redis_client: Redis):
    """Twenty gids each hold their own conversation after a 40-block system prompt: page 1 holds
    the prompt's last 8 blocks and twenty branches. A new conversation stops there for every gid:
    the page's stem says so at once (no look at each gid's leaves), and exactly."""
    await redis_client.flushall()
    scripts = Scripts(redis_client)
    rng = random.Random(4)
    system = [rng.getrandbits(64) for _ in range(40)]
    for g in range(20):
        await PageWriter(scripts, 1000 + g).hold([system + [rng.getrandbits(64) for _ in range(30)]])
    page1 = await redis_client.hgetall(KEYS.segment(system[PAGE_BLOCKS]))
    assert page1[f"c:{system[PAGE_BLOCKS]:016x}".encode()] == "".join(f"{h:016x}" for h in system[32:]).encode()
    assert len(page1[f"K:{system[PAGE_BLOCKS]:016x}".encode()].split(b",")) == 20 + 2  # a block after it per gid
    query = system + [rng.getrandbits(64) for _ in range(30)]
    await redis_client.config_resetstat()
    chained, apart = await match_both_ways(scripts, query)
    assert chained == apart == {1000 + g: 40 for g in range(20)}
    calls = (await redis_client.info("commandstats")).get("cmdstat_hget", {}).get("calls", 0)
    assert calls <= 4  # the stem, once per way of matching (and no gid's leaves)
    # Page 1 answers by its holder list under the stem's depth, negative: no work per gid.
    pages = pages_of(query)
    whole, stops = (await scripts.run(lua.page_match(KEYS, pages, query, chained=True)))[1]
    assert whole == b"," and stops[0] == -8 and len(stops) == 2
    assert {int(g) for g in stops[1].split(b",") if g} == {1000 + g for g in range(20)}


async def test_a_branch_that_leaves_the_stem_early_shortens_it_and_matches_stay_exact(redis_client: Redis):
    await redis_client.flushall()
    scripts = Scripts(redis_client)
    rng = random.Random(5)
    system = [rng.getrandbits(64) for _ in range(40)]
    a, b, c = (PageWriter(scripts, gid) for gid in (7, 8, 9))
    long_a = system + [rng.getrandbits(64) for _ in range(20)]
    await a.hold([long_a])
    await b.hold([system + [rng.getrandbits(64) for _ in range(20)]])
    early = system[:35] + [rng.getrandbits(64) for _ in range(20)]  # leaves the stem at block 35
    await c.hold([early])
    stem = await redis_client.hget(KEYS.segment(system[PAGE_BLOCKS]), f"c:{system[PAGE_BLOCKS]:016x}")
    assert len(stem) == 16 * 3  # blocks 32, 33, 34
    assert (await match_both_ways(scripts, long_a)) == ({7: 60, 8: 40, 9: 35}, {7: 60, 8: 40, 9: 35})
    await a.hold([long_a[:45]])  # a's branch shortens; c lets go: the stem stays as it is
    await c.hold([])
    assert (await match_both_ways(scripts, long_a)) == ({7: 45, 8: 40}, {7: 45, 8: 40})
    await a.hold([])
    await b.hold([])
    assert await redis_client.keys(KEYS.bucket_base("*") + "s:*") == []  # stems gone with the holders
