"""The writer's page bookkeeping (kvindex.page_writes, kvindex.pages): whatever the engine stores
and evicts, the holdings a generation has sent are the pages' holdings of the blocks its mirror
indexes, and a re-assert's write states them all."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvindex.mirror import BlockMirror
from kvindex.page_writes import PagePlacer, SentPages, log_entries, plan_pages
from kvindex.pages import PAGE_BLOCKS, Page, combine, holding_changes, page_holdings, pages_of, segment_start
from kvindex.types import RemovedBlocks, StoredRun


def test_segments_double_along_a_chain():
    assert [segment_start(p) for p in range(9)] == [0, 1, 2, 2, 4, 4, 4, 4, 8]
    chain = list(range(1000, 1000 + 5 * PAGE_BLOCKS + 3))
    pages = pages_of(chain)
    assert [(p.start, p.length) for p in pages] == [(0, 32), (32, 32), (64, 32), (96, 32), (128, 32), (160, 3)]
    assert [p.segment for p in pages] == [chain[0], chain[32], chain[64], chain[64], chain[128], chain[128]]


def test_a_branch_that_starts_another_is_not_a_holding():
    trunk = list(range(1, 41))
    holdings = page_holdings([trunk, trunk[:35], [*trunk[:34], 99]])
    assert holdings[(1, 1)] == {32: tuple(range(1, 33))}
    assert holdings[(33, 33)] == {40: tuple(range(33, 41)), 99: (33, 34, 99)}


def test_combine_credits_whole_pages_then_the_stop():
    pages = [Page(1, 0, 32, 1), Page(2, 32, 32, 2), Page(3, 64, 10, 3)]
    replies = [[b",7,8,9,", []], [b",7,8,", [5, b",9,"]], [b",7,", [3, b",8,"]]]
    assert combine(pages, replies) == {7: 74, 8: 67, 9: 37}
    assert combine(pages, [[b",", [4, b",7,"]]]) == {7: 4}  # the walk ended at page 0


@st.composite
def engine_events(draw):
    """Stores of chains that share prefixes (a forest of branches, some past two pages) and
    evictions of what was stored, as an engine sends them."""
    rng = random.Random(draw(st.integers(0, 2**32)))
    chains: list[list[int]] = []
    events: list = []
    for _ in range(draw(st.integers(1, 12))):
        if chains and rng.random() < 0.35:
            chain = rng.choice(chains)
            cut = rng.randrange(len(chain))
            events.append(RemovedBlocks(tuple(reversed(chain[cut:]))))
        else:
            base = rng.choice(chains)[: rng.randint(1, 70)] if chains and rng.random() < 0.7 else []
            chain = base + [rng.getrandbits(64) for _ in range(rng.randint(1, 90))]
            chains.append(chain)
            start = rng.randrange(len(chain)) if base else 0
            parent = chain[start - 1] if start else None
            events.append(StoredRun(parent, tuple(chain[start:])))
    return events


def indexed_chains(mirror: BlockMirror) -> list[list[int]]:
    """Every indexed block's chain from its first block (the mirror's view, blocks by parent)."""
    adds = mirror.indexed_in_order()
    parent = {a.block: a.parent for a in adds}
    chains = []
    for block in parent:
        chain = [block]
        while parent[chain[-1]] is not None:
            chain.append(parent[chain[-1]])  # type: ignore[arg-type]
        chains.append(chain[::-1])
    return chains


@settings(max_examples=200, deadline=None)
@given(events=engine_events())
def test_the_holdings_sent_are_the_mirrors_pages_after_every_write(events):
    mirror, placer, sent = BlockMirror(), PagePlacer(), SentPages()
    for event in events:
        ops, _ = mirror.apply([event])
        plan_pages(placer, sent, placer.apply(ops))
        assert sent.holdings == page_holdings(indexed_chains(mirror))
        assert len(placer) == mirror.indexed_count
    # A re-assert sends every page afresh, and its changes gain exactly the holdings.
    fresh = SentPages()
    plans = plan_pages(placer, fresh, placer.sizes())
    assert fresh.holdings == sent.holdings
    assert sum(plan.block_delta for plan in plans) == mirror.indexed_count
    by_page = sorted((c for p in plans for c in p.changes), key=lambda c: (c.segment, c.first))
    assert by_page == holding_changes({}, sent.holdings)
    assert sum(fresh.per_bucket.values()) == len(fresh.holdings)
    assert len(log_entries(list(fresh.holdings))) == 32 * len(fresh.holdings)
