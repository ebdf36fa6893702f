"""SGLang's pages re-blocked into the index's blocks (worker_agent/pages.py), checked against a
model of a paged radix cache, and against the events SGLang's own code made
(tests/fixtures/sglang/).

A toy paged engine keeps pages of ``page`` tokens (the last page of a prompt may be shorter, as a
radix node's is), evicts leaves as a radix cache does, and emits SGLang-shaped events. After every
step, for every prompt, the index must match exactly the whole blocks of the prefix the engine
holds: never a block the engine does not hold whole.
"""

from __future__ import annotations

import asyncio
import hashlib

from hypothesis import given, settings
from hypothesis import strategies as st

from kvevents import sglang
from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored, Event
from kvindex.hashing import sequence_hashes
from kvindex.reference import ReferenceIndex
from kvindex.types import WorkerInfo
from tests.support.captures import sglang_messages
from worker_agent.pages import PageBlocks
from worker_agent.translate import Translator

BS = 8
MODEL = "m"
SHARED = [(i * 5 + 3) % 97 for i in range(20)]
DOCS = [SHARED + [(i * 11 + 1) % 97 for i in range(19)], SHARED + [(i * 13 + 7) % 97 for i in range(14)]]
SALTS = [None, "tenant-a"]


def page_hash(tokens: tuple[int, ...], salt: str | None) -> int:
    digest = hashlib.sha256(repr((salt, tokens)).encode()).digest()
    return int.from_bytes(digest[:8], "little", signed=True)  # SGLang's hashes are signed int64


class PagedEngine:
    def __init__(self, page: int) -> None:
        self.page = page
        self.held: dict[int, tuple[tuple[int, ...], str | None]] = {}  # page hash -> (prefix, salt)

    def pages(self, doc: int, salt: str | None) -> list[tuple[int, tuple[int, ...]]]:
        tokens = tuple(DOCS[doc])
        ends = [*range(self.page, len(tokens), self.page), len(tokens)]
        return [(page_hash(tokens[:end], salt), tokens[:end]) for end in ends]

    def store(self, doc: int, salt: str | None, n: int) -> list[Event]:
        chain = self.pages(doc, salt)[:n]
        first = next((i for i, (h, _) in enumerate(chain) if h not in self.held), len(chain))
        events: list[Event] = []
        parent = chain[first - 1][0] if first else None
        for h, prefix in chain[first:]:
            self.held[h] = (prefix, salt)
            start = len(chain[chain.index((h, prefix)) - 1][1]) if chain.index((h, prefix)) else 0
            page_tokens = prefix[start:]
            extra = ([salt],) if salt and parent is None else None
            events.append(BlockStored((h,), parent, page_tokens, len(page_tokens), extra_keys=extra))
            parent = h
        return events

    def evict(self, pick: int) -> list[Event]:
        leaves = sorted(h for h, (prefix, salt) in self.held.items() if not self._has_child(prefix, salt))
        if not leaves:
            return []
        victim = leaves[pick % len(leaves)]
        del self.held[victim]
        return [BlockRemoved((victim,))]

    def _has_child(self, prefix: tuple[int, ...], salt: str | None) -> bool:
        return any(s == salt and len(p) > len(prefix) and p[: len(prefix)] == prefix for p, s in self.held.values())

    def clear(self) -> list[Event]:
        self.held.clear()
        return [AllBlocksCleared()]

    def served_tokens(self, doc: int, salt: str | None) -> int:
        served = 0
        for h, prefix in self.pages(doc, salt):
            if h not in self.held:
                break
            served = len(prefix)
        return served


STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("store"), st.integers(0, 1), st.sampled_from(SALTS), st.integers(1, 40)),
        st.tuples(st.just("evict"), st.integers(0, 1000), st.none(), st.just(0)),
        st.tuples(st.just("clear"), st.just(0), st.none(), st.just(0)),
    ),
    max_size=30,
)


async def _run(page: int, steps: list[tuple]) -> None:
    engine, pages, translator, index = PagedEngine(page), PageBlocks(BS), Translator(BS), ReferenceIndex()
    await index.register(WorkerInfo("w", MODEL, "http://w", BS), 60_000)
    for number, (kind, doc, salt, n) in enumerate(steps):
        events = (
            engine.store(doc, salt, n) if kind == "store" else engine.evict(doc) if kind == "evict" else engine.clear()
        )
        _, decoded, *_ = sglang.decode_payload(sglang.encode_payload(events))  # through SGLang's wire
        batch = translator.translate(pages.translate(decoded))
        if batch.clear:
            await index.handle(MODEL, "w").clear()
        await index.handle(MODEL, "w").apply(batch.changes)
        for d in range(len(DOCS)):
            for s in SALTS:
                got = (await index.match(MODEL, sequence_hashes(DOCS[d], BS, cache_salt=s)))["w"]
                assert got == engine.served_tokens(d, s) // BS, f"step {number} {kind}: doc {d} salt {s}"
    assert translator.counters.orphan_runs == 0
    assert translator.counters.unknown_removals == 0


@settings(max_examples=150, deadline=None)
@given(st.sampled_from([1, 3, 4, 8, 16]), STEPS)
def test_the_index_holds_exactly_the_whole_blocks_the_paged_engine_holds(page, steps):
    asyncio.run(_run(page, steps))


def test_a_page_on_two_tiers_is_counted_on_each_and_removed_from_each():
    pages = PageBlocks(4)
    tokens = tuple(range(8))
    stored = pages.translate([BlockStored((1, 2), None, tokens, 4, medium="GPU")])
    backed_up = pages.translate([BlockStored((1, 2), None, tokens, 4, medium="CPU_PINNED")])
    assert [e.medium for e in stored + backed_up if isinstance(e, BlockStored)] == [
        "GPU",
        "GPU",
        "CPU_PINNED",
        "CPU_PINNED",
    ]
    gone = pages.translate([BlockRemoved((2, 1), medium="GPU")])
    assert [len(e.block_hashes) for e in gone if isinstance(e, BlockRemoved)] == [2] and len(pages) == 2
    pages.translate([BlockRemoved((2, 1), medium="CPU_PINNED")])
    assert len(pages) == 0


# --- SGLang's own events (tests/fixtures/sglang/make_captures.py) --------------------------------


def fixture_tokens(start: int, count: int) -> list[int]:
    """The token ids make_captures.py gave its radix tree's nodes."""
    return [1000 + (start + i) * 7 % 5000 for i in range(count)]


def indexed_after(name: str, block_size: int = 16) -> list[tuple[set[int], dict[str, int]]]:
    """What the index holds on the GPU after each live message of a capture (our hashes)."""
    pages, translator, held = PageBlocks(block_size), Translator(block_size), set()
    out = []
    for frames in sglang_messages(name):
        batch = sglang.decode_message(frames)
        translated = translator.translate(pages.translate(batch.events))
        if translated.clear:
            held.clear()
        for change in translated.changes:
            if hasattr(change, "parent"):
                held.update(change.hashes)
            else:
                held.difference_update(change.hashes)
        out.append((set(held), dict(batch.unreproducible)))
    return out


def test_sglang_0523_events_index_the_router_s_hashes_at_any_page_size():
    system, turn = fixture_tokens(0, 48), fixture_tokens(100, 20)
    other = fixture_tokens(200, 33)
    expect_system = set(sequence_hashes(system, 16))
    expect_turn = set(sequence_hashes(system + turn, 16))
    expect_other = set(sequence_hashes(system + other, 16))
    salted = set(sequence_hashes(fixture_tokens(0, 40), 16, cache_salt="tenant-a"))
    adapter = set(sequence_hashes(fixture_tokens(0, 32), 16, lora_name="sql-adapter"))
    for page, bigrams in ((1, 24), (16, 2)):
        steps = indexed_after(f"sglang-0.5.23-page{page}")
        assert steps[0][0] == expect_system
        assert steps[1][0] == expect_turn | expect_other
        assert steps[3][0] == expect_other  # the turn's node was removed: its 4th block goes
        assert steps[4][0] == expect_other | salted
        assert steps[5][0] == expect_other | salted | adapter
        assert steps[6] == (expect_other | salted | adapter, {sglang.EAGLE_BIGRAMS: bigrams})
        assert steps[7][0] == salted | adapter
        assert steps[8][0] == set()


def test_sglang_049_positional_events_and_topicless_replies_decode_alike():
    live = sglang_messages("sglang-0.4.9-page4")
    replayed = sglang_messages("sglang-0.4.9-page4", "replay")
    assert len(replayed) == len(live) and all(len(frames) == 2 for frames in replayed)  # [seq, payload]
    for frames, again in zip(live, replayed, strict=True):
        assert sglang.decode_message(frames).events == sglang.decode_message(again, "kv").events
    steps = indexed_after("sglang-0.4.9-page4")
    system = fixture_tokens(0, 48)
    assert steps[0][0] == set(sequence_hashes(system, 16))
    assert steps[1][0] == set(sequence_hashes(system + fixture_tokens(100, 20), 16))
    assert steps[2][0] == set(sequence_hashes(system, 16)) and steps[3][0] == set()
