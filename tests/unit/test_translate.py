"""Translation of engine events into index changes, checked against a model of the engine's cache.

A toy engine (tests/support/toy_engine.py) keeps its own cache and emits vLLM-shaped events; they are
decoded and translated, and the translator's output goes into the reference index. After every
step, for every prompt, the index must match exactly the number of leading blocks the engine
holds (the engine can serve a prefix only while every block of it is cached).
"""

from __future__ import annotations

import asyncio

from hypothesis import given, settings

from kvevents.vllm import AllBlocksCleared, BlockRemoved, BlockStored, decode_payload, encode_payload
from kvindex.hashing import sequence_hashes
from kvindex.reference import ReferenceIndex
from kvindex.types import RemovedBlocks, StoredRun, WorkerInfo
from tests.support.toy_engine import BS, DOCS, SALTS, STEPS, ToyEngine, engine_step
from worker_agent.translate import Translator

MODEL = "m"


async def _run(steps: list[tuple]) -> None:
    engine, translator, index = ToyEngine(), Translator(BS), ReferenceIndex()
    await index.register(WorkerInfo("w", MODEL, "http://w", BS), 60_000)
    for step, (kind, *_) in enumerate(steps):
        # through the wire and back, as the agent receives them
        _, events, *_ = decode_payload(encode_payload(engine_step(engine, steps[step])))
        batch = translator.translate(events)
        if batch.clear:
            await index.handle(MODEL, "w").clear()
        await index.handle(MODEL, "w").apply(batch.changes)
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
            BlockStored((2,), None, tokens, BS, medium="TAPE"),  # a medium no engine reports
            BlockStored((3,), None, tokens, BS, group_idx=1),
            BlockStored((4,), None, tuple(range(2 * BS)), 2 * BS),
            BlockStored((5,), None, tokens, BS, extra_keys=(["mm-hash", "salt"],)),
            # a window's span (found by test_wire_fuzz.py) with no group index: not the chains' group
            BlockStored((), None, tokens, BS, kv_cache_spec_kind="sliding_window"),
            BlockRemoved((77,)),
            BlockRemoved((2,), medium="TAPE"),
        ]
    )
    assert batch.changes == []
    c = translator.counters
    assert (c.orphan_runs, c.orphan_blocks, c.other_tier_events, c.other_group_events) == (1, 1, 2, 2)
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


def test_each_tier_is_translated_apart_and_a_block_moving_between_tiers_keeps_its_hash():
    """vLLM's offloading: a block stored on the GPU, copied to the CPU, evicted from the GPU, then
    from the CPU. One engine hash, one content: our hash is the same in every tier, and its copies
    are counted per tier (removing it from the GPU leaves the CPU's)."""
    translator = Translator(BS)
    tokens = tuple(range(2 * BS))
    ours = tuple(sequence_hashes(list(tokens), BS))
    stored = translator.translate([BlockStored((1, 2), None, tokens, BS, medium="GPU")])
    assert stored.changes == [StoredRun(None, ours)] and stored.lower == {}
    offloaded = translator.translate([BlockStored((1, 2), None, tokens, BS, medium="CPU")])
    assert offloaded.changes == [] and offloaded.lower == {"CPU": [StoredRun(None, ours)]}
    evicted = translator.translate([BlockRemoved((2, 1), medium="GPU")])
    assert evicted.changes == [RemovedBlocks(ours[::-1])] and evicted.lower == {}
    # the CPU's copy still names the content: a child stored on the CPU chains to it
    child = translator.translate([BlockStored((3,), 2, tuple(range(2 * BS, 3 * BS)), BS, medium="cpu")])
    assert child.lower["CPU"] == [StoredRun(ours[-1], tuple(sequence_hashes(list(range(3 * BS)), BS))[2:])]
    gone = translator.translate([BlockRemoved((3, 2, 1), medium="CPU")])
    assert len(gone.lower["CPU"][0].hashes) == 3 and len(translator) == 0
    assert translator.counters.unknown_removals == 0


def test_tiers_left_out_are_counted_and_skipped():
    translator = Translator(BS, tiers=frozenset({"GPU"}))
    tokens = tuple(range(BS))
    batch = translator.translate([BlockStored((1,), None, tokens, BS, medium="CPU"), BlockRemoved((1,), medium="CPU")])
    assert batch.changes == [] and batch.lower == {} and translator.counters.other_tier_events == 2
