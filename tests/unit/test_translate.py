"""Translation of engine events into index changes, checked against a model of the engine's cache.

A toy engine keeps its own cache (content-addressed blocks with copies, its own hash function,
as vLLM does) and emits vLLM-shaped events; the translator's output goes into the reference
index. After every step, for every prompt, the index must match exactly the number of leading
blocks the engine holds (the engine can serve a prefix only while every block of it is cached).
"""

from __future__ import annotations

import asyncio
import hashlib

from hypothesis import given, settings
from hypothesis import strategies as st

from kvindex.hashing import sequence_hashes
from kvindex.reference import ReferenceIndex
from kvindex.types import RemovedBlocks, StoredRun, WorkerInfo
from worker_agent.translate import Translator
from worker_agent.wire import AllBlocksCleared, BlockRemoved, BlockStored

BS = 4
MODEL = "m"
# Prompts share prefixes: two "documents" of 4 blocks; prompt = doc blocks [0, n). Few blocks,
# so that random steps often hit the same block (duplicates, repeated evictions).
DOCS = [[(d * 7 + i * 3 + j) % 50 for i in range(4) for j in range(BS)] for d in range(2)]
SALTS = [None, "tenant-a"]


def engine_hash(tokens: tuple[int, ...], salt: str | None) -> int:
    """The engine's own hash of a prefix: unrelated to ours, like vLLM's sha256 truncated."""
    digest = hashlib.sha256(repr((salt, tokens)).encode()).digest()
    return int.from_bytes(digest[:8], "little")


class ToyEngine:
    def __init__(self) -> None:
        self.copies: dict[int, int] = {}  # engine hash -> copies
        self.content: dict[int, tuple[tuple[int, ...], str | None]] = {}

    def chain(self, doc: int, salt: str | None) -> list[int]:
        tokens = tuple(DOCS[doc])
        return [engine_hash(tokens[: (i + 1) * BS], salt) for i in range(len(tokens) // BS)]

    def store(self, doc: int, salt: str | None, n: int, duplicate_last: bool) -> list[object]:
        chain = self.chain(doc, salt)[:n]
        first = next((i for i, h in enumerate(chain) if h not in self.copies), len(chain))
        if duplicate_last and first == len(chain):
            first = len(chain) - 1  # vLLM recomputes a fully cached prompt's last block
        if first >= len(chain):
            return []
        hashes = chain[first:]
        for h in hashes:
            self.copies[h] = self.copies.get(h, 0) + 1
        tokens = tuple(DOCS[doc][first * BS : len(chain) * BS])
        extra = [[salt] if salt and first == 0 and i == 0 else None for i in range(len(hashes))]
        parent = chain[first - 1] if first else None
        return [BlockStored(tuple(hashes), parent, tokens, BS, extra_keys=tuple(extra))]

    def evict(self, pick: int) -> list[object]:
        if not self.copies:
            return []
        victim = sorted(self.copies)[pick % len(self.copies)]
        self.copies[victim] -= 1
        if not self.copies[victim]:
            del self.copies[victim]
        return [BlockRemoved((victim,))]

    def clear(self) -> list[object]:
        self.copies.clear()
        return [AllBlocksCleared()]

    def served_prefix(self, doc: int, salt: str | None) -> int:
        n = 0
        for h in self.chain(doc, salt):
            if h not in self.copies:
                break
            n += 1
        return n


STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("store"), st.integers(0, 1), st.sampled_from(SALTS), st.integers(1, 4), st.booleans()),
        st.tuples(st.just("evict"), st.integers(0, 1000), st.none(), st.just(0), st.just(False)),
        st.tuples(st.just("evict"), st.integers(0, 1000), st.none(), st.just(0), st.just(False)),
        st.tuples(st.just("clear"), st.just(0), st.none(), st.just(0), st.just(False)),
    ),
    max_size=40,
)


async def _run(steps: list[tuple]) -> None:
    engine, translator, index = ToyEngine(), Translator(BS), ReferenceIndex()
    await index.register(WorkerInfo("w", MODEL, "http://w", BS), 60_000)
    for step, (kind, doc, salt, n, dup) in enumerate(steps):
        if kind == "store":
            events = engine.store(doc, salt, n, dup)
        elif kind == "evict":
            events = engine.evict(doc)
        else:
            events = engine.clear()
        batch = translator.translate(events)  # type: ignore[arg-type]
        if batch.clear:
            await index.clear(MODEL, "w")
        await index.apply(MODEL, "w", batch.changes)
        for d in range(len(DOCS)):
            for s in SALTS:
                ours = sequence_hashes(DOCS[d], BS, cache_salt=s)
                got = (await index.match(MODEL, ours))["w"]
                assert got == engine.served_prefix(d, s), f"step {step} {kind}: doc {d} salt {s}"
    assert translator.counters.orphan_runs == 0
    assert translator.counters.unknown_removals == 0


@settings(max_examples=300, deadline=None)
@given(STEPS)
def test_the_index_serves_exactly_what_the_engine_holds(steps):
    asyncio.run(_run(steps))


def test_salt_and_lora_enter_the_hash_like_the_router_computes_it():
    tokens = list(range(2 * BS))
    translator = Translator()
    event = BlockStored((11, 12), None, tuple(tokens), BS, lora_name="ad1", extra_keys=(["ad1", "s1"], ["ad1"]))
    batch = translator.translate([event])
    assert batch.changes == [StoredRun(None, tuple(sequence_hashes(tokens, BS, lora_name="ad1", cache_salt="s1")))]
    assert translator.block_size == BS


def test_unknown_parents_other_tiers_groups_and_block_sizes_are_counted_and_skipped():
    translator = Translator(BS)
    tokens = tuple(range(BS))
    batch = translator.translate(
        [
            BlockStored((1,), 999, tokens, BS),  # parent never seen
            BlockStored((2,), None, tokens, BS, medium="CPU"),
            BlockStored((3,), None, tokens, BS, group_idx=1),
            BlockStored((4,), None, tuple(range(2 * BS)), 2 * BS),
            BlockStored((5,), None, tokens, BS, extra_keys=(["mm-hash", "salt"],)),
            BlockRemoved((77,)),
            BlockRemoved((2,), medium="CPU"),
        ]
    )
    assert batch.changes == []
    c = translator.counters
    assert (c.orphan_runs, c.orphan_blocks, c.other_tier_events, c.other_group_events) == (1, 1, 2, 1)
    assert (c.block_size_mismatches, c.unsupported_extra_keys, c.unknown_removals) == (1, 1, 1)


def test_a_clear_drops_the_changes_before_it_and_the_map():
    translator = Translator(BS)
    tokens = tuple(range(BS))
    batch = translator.translate(
        [BlockStored((1,), None, tokens, BS), AllBlocksCleared(), BlockStored((2,), None, tokens, BS)]
    )
    assert batch.clear
    assert batch.changes == [StoredRun(None, tuple(sequence_hashes(list(tokens), BS)))]
    assert translator.our_hash(1) is None and translator.our_hash(2) is not None


def test_removals_follow_reference_counts_of_duplicate_stores():
    translator = Translator(BS)
    tokens = tuple(range(BS))
    ours = sequence_hashes(list(tokens), BS)[0]
    translator.translate([BlockStored((7,), None, tokens, BS), BlockStored((7,), None, tokens, BS)])
    assert translator.translate([BlockRemoved((7,))]).changes == [RemovedBlocks((ours,))]
    assert translator.our_hash(7) == ours
    assert translator.translate([BlockRemoved((7,))]).changes == [RemovedBlocks((ours,))]
    assert translator.our_hash(7) is None
