"""Hybrid models (kvindex/groups.py): a worker's hit as vLLM's hybrid cache manager finds it,
checked against a real vLLM 0.32 capture (tests/fixtures/.../run5_sliding_window_*: the tiny
model with one sliding-window layer, window 64, and one full-attention layer, a 40-block cache):
replaying the engine's events through the agent's translation into the index, the hit the router
computes for each request is the cached tokens the engine reported, on every request."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest

from kvevents.vllm import BlockRemoved, BlockStored, decode_message
from kvindex.groups import GroupSpec, format_groups, group_hit, hybrid_hit, parse_groups
from kvindex.hashing import sequence_hashes
from kvindex.reference import ReferenceIndex
from kvindex.types import WorkerInfo
from router.routing.hybrid import hit_limits, hybrid_matches
from tests.conftest import CAPTURES
from tests.unit.test_wire import raw_messages
from worker_agent.translate import Translator

BS = 32
SLIDING = GroupSpec(0, "sliding_window", BS, 64)  # a hit needs cdiv(63, 32) = 2 blocks in a row
FULL = GroupSpec(1, "full_attention", BS)
MAMBA = GroupSpec(2, "mamba", BS)


def test_a_sliding_window_hit_ends_at_the_last_run_of_its_window():
    assert SLIDING.run_needed() == 2
    assert group_hit(SLIDING, {0, 1, 2, 3}, 4 * BS) == 4 * BS
    assert group_hit(SLIDING, {2, 3}, 4 * BS) == 4 * BS  # the blocks before the window are not needed
    assert group_hit(SLIDING, {1, 2}, 4 * BS) == 3 * BS  # scanning back: the run that ends at block 3
    assert group_hit(SLIDING, {3}, 4 * BS) == 0  # one block is not a window
    assert group_hit(SLIDING, {0, 3}, 4 * BS) == 1 * BS  # none found: the held run from the start counts
    assert group_hit(SLIDING, {2, 3}, 3 * BS) == 0  # only within the limit


def test_a_mamba_hit_is_its_deepest_state_and_nothing_from_the_start_alone():
    assert group_hit(MAMBA, {1, 5}, 4 * BS) == 2 * BS
    assert group_hit(MAMBA, set(), 4 * BS) == 0


def test_the_hit_shrinks_until_every_group_accepts_it():
    # the window accepts 3 blocks, the state only 2 then: and at 2 the window still holds 0-1
    held = {0: {0, 1, 2}, 2: {1}}
    assert hybrid_hit((FULL, SLIDING, MAMBA), held, 4 * BS) == 2 * BS
    assert hybrid_hit((FULL, SLIDING), {0: {0, 1, 2}}, 4 * BS) == 3 * BS


def test_groups_read_back_as_the_records_keep_them():
    groups = (SLIDING, FULL, GroupSpec(3, "mamba", 64))
    assert parse_groups(format_groups(groups)) == (SLIDING, FULL, GroupSpec(3, "mamba", 64))
    with pytest.raises(ValueError, match="index:kind:block_size:window"):
        parse_groups("0:sliding_window:32")


def test_without_a_full_attention_group_every_worker_may_reach_the_prompts_end():
    assert hit_limits((SLIDING,), {"a": 0, "b": 3}, 129, BS) == {"a": 128, "b": 128}
    assert hit_limits((FULL, SLIDING), {"a": 0, "b": 5}, 128, BS) == {"a": 0, "b": 96}


def _captured() -> tuple[list, list[dict]]:
    batches = [decode_message(frames) for frames in raw_messages("run5_sliding_window_events")]
    requests = json.loads((CAPTURES / "run5_sliding_window_http.json").read_text())
    return batches, requests


def test_the_capture_has_both_groups_and_the_window_caches_only_tails():
    batches, _ = _captured()
    stores = [e for b in batches for e in b.events if isinstance(e, BlockStored)]
    kinds = {(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window or None) for e in stores}
    assert kinds == {(0, "sliding_window", 64), (1, "full_attention", None)}
    # the window group names fewer blocks than its span's tokens hold (the rest slid out)
    assert any(len(e.block_hashes) < len(e.token_ids) // BS for e in stores if e.group_idx == 0)
    assert any(isinstance(e, BlockRemoved) and e.group_idx == 0 for b in batches for e in b.events)


async def replayed() -> AsyncIterator[tuple[dict, ReferenceIndex, Translator]]:
    """Each captured request, with the index as the agent left it from the engine's events that
    came before it."""
    batches, requests = _captured()
    index, translator = ReferenceIndex(), Translator()
    handle = await index.register(WorkerInfo("w", "tiny", "http://w", BS))
    at = 0
    for request in requests:
        while at < len(batches) and batches[at].seq <= request["after_seq"]:
            translated = translator.translate(batches[at].events)
            if translated.clear:
                await handle.clear()
            await handle.apply(translated.changes)
            at += 1
        yield request, index, translator


async def test_predicted_equals_reported_on_every_request_of_a_real_sliding_window_model():
    nonzero = 0
    async for request, index, translator in replayed():
        groups = tuple(translator.groups.values())
        prompt = request["prompt"]
        chain = sequence_hashes(prompt, BS)
        matches = await index.match("tiny", chain)
        hits = await hybrid_matches(index, "tiny", groups, chain, len(prompt), BS, matches)
        assert hits["w"] * BS == request["cached_tokens"], (len(prompt), matches, hits)
        nonzero += request["cached_tokens"] > 0
    assert nonzero >= 10
    assert translator.counters.orphan_runs == 0 and translator.counters.window_blocks_stored > 0


async def test_the_full_attention_prefix_alone_overstates_the_captures_hits():
    overstated = 0
    async for request, index, _ in replayed():
        prompt = request["prompt"]
        full = min((await index.match("tiny", sequence_hashes(prompt, BS)))["w"] * BS, (len(prompt) - 1) // BS * BS)
        overstated += full > request["cached_tokens"]
    assert overstated >= 3
