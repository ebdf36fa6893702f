"""TensorRT-LLM's KV events (kvevents/trtllm.py) and load (worker_agent/iteration_stats.py): what
its own serializer wrote (tests/fixtures/trtllm/) indexes the router's hashes per tier, malformed
input is a WireError and nothing else, and 100,000 mutated events never crash the decoder, the
re-blocking or the translation behind it."""

from __future__ import annotations

import json
import random

import pytest

from kvevents import trtllm
from kvevents.events import BlockMoved, BlockRemoved, BlockStored, EventBatch, WireError
from kvindex.hashing import sequence_hashes
from kvindex.types import WorkerLoad
from tests.support.captures import FIXTURES
from tests.unit.test_wire_fuzz import MUTATED_FRAMES, mutate_bytes
from worker_agent.iteration_stats import parse_iteration_stats
from worker_agent.pages import PageBlocks
from worker_agent.translate import Translator

POLLS = json.loads((FIXTURES / "trtllm" / "kv-cache-events.json").read_text())
EVENTS = [event for answer in POLLS for event in answer]


def frames_of(event: dict) -> list[bytes]:
    """As worker_agent/poller.py hands an event on."""
    return [b"trtllm", event["event_id"].to_bytes(8, "big"), json.dumps(event).encode()]


def fixture_tokens(start: int, count: int) -> list[int]:
    return [100 + (start + i) * 3 % 900 for i in range(count)]


def test_what_tensorrt_llm_wrote_is_indexed_per_tier_in_the_router_s_hashes():
    pages, translator = PageBlocks(16), Translator(16)
    held: dict[str, set[int]] = {"GPU": set(), "CPU": set()}
    after, unreproducible = [], {}
    for answer in POLLS:
        for event in answer:
            batch = trtllm.decode_message(frames_of(event))
            assert batch.seq == event["event_id"] and not batch.unknown_keys and not batch.unknown_events
            for reason, count in batch.unreproducible.items():
                unreproducible[reason] = unreproducible.get(reason, 0) + count
            translated = translator.translate(pages.translate(batch.events))
            if translated.clear:
                held = {"GPU": set(), "CPU": set()}
            for tier in held:
                for change in translated.of(tier):
                    (held[tier].update if hasattr(change, "parent") else held[tier].difference_update)(change.hashes)
        after.append({tier: set(blocks) for tier, blocks in held.items()})
    system = sequence_hashes(fixture_tokens(0, 29), 16)  # 29 tokens in 8-token blocks: one index block
    turn = sequence_hashes(fixture_tokens(0, 24) + fixture_tokens(50, 16), 16)
    assert after[0] == {"GPU": {*system, *turn}, "CPU": set()}
    assert after[1] == {"GPU": set(), "CPU": {system[0]}}  # block 2 of 8 tokens (completing it) offloaded
    assert after[2] == after[1]  # an empty poll
    assert after[3] == {"GPU": set(), "CPU": set()}  # back on the GPU, then removed from wherever it was
    assert unreproducible == {trtllm.EXTRA_TOKEN_IDS: 2}
    assert translator.counters.orphan_runs == translator.counters.unknown_removals == 0


def test_blocks_of_one_event_split_into_runs_of_one_size_and_level():
    event = trtllm.stored_json(3, 11, [(1, [5] * 8), (2, [6] * 8), (3, [7] * 3)])
    event["data"]["blocks"][1]["cache_level"] = 1
    (first, second, third), _, _ = trtllm.decode_event(event)
    assert isinstance(first, BlockStored) and (first.block_hashes, first.parent_block_hash, first.medium) == (
        (1,),
        11,
        "GPU",
    )
    assert isinstance(second, BlockStored) and (second.parent_block_hash, second.medium) == (1, "CPU")
    assert isinstance(third, BlockStored) and (third.block_size, third.parent_block_hash) == (3, 2)
    assert first.group_idx == 4096  # the attention window: the agent indexes one


def test_moves_removals_and_what_cannot_be_hashed():
    moved, _, _ = trtllm.decode_event(trtllm.updated_json(4, 9, 0, 1))
    assert moved == [BlockMoved((9,), "GPU", "CPU", 4096)]
    removed, _, _ = trtllm.decode_event(trtllm.removed_json(5, [-1]))
    assert removed == [BlockRemoved(((1 << 64) - 1,), medium="*", group_idx=4096)]
    lora = trtllm.stored_json(6, None, [(1, [5] * 8), (2, [6] * 8)])
    lora["data"]["blocks"][0]["lora_id"] = 3
    assert trtllm.decode_event(lora)[:2] == ([], {trtllm.UNNAMED_LORA: 2})
    multimodal = trtllm.stored_json(7, None, [(1, [5] * 8)])
    multimodal["data"]["blocks"][0]["mm_keys"] = [["ab", 0]]
    assert trtllm.decode_event(multimodal)[:2] == ([], {trtllm.MULTIMODAL: 1})
    unknown = {"event_id": 8, "data": {"type": "resized"}, "window_size": 1, "extra": 1}
    assert trtllm.decode_event(unknown) == ([], {}, {"data.type=resized", "extra"})


@pytest.mark.parametrize(
    "event, error",
    [
        ([], "must be a JSON object"),
        ({"event_id": 1}, "'data' object with a string 'type'"),
        ({"event_id": 1, "data": {"type": "stored", "parent_hash": None, "blocks": []}}, "non-empty 'blocks'"),
        ({"event_id": 1, "data": {"type": "stored", "parent_hash": "x", "blocks": [1]}}, "parent_hash must be"),
        ({"event_id": 1, "data": {"type": "stored", "parent_hash": None, "blocks": [{"block_hash": 1}]}}, "'tokens'"),
        ({"event_id": 1, "data": {"type": "removed", "block_hashes": [1 << 64]}}, "block_hashes must be"),
        ({"event_id": 1, "data": {"type": "removed"}}, "non-empty 'block_hashes'"),
        ({"event_id": 1, "data": {"type": "created"}, "window_size": -1}, "window_size must be"),
        (trtllm.updated_json(1, 2, 0, "one"), "cache_level must be"),
    ],
)
def test_malformed_events_are_wire_errors_that_say_what_is_wrong(event, error):
    with pytest.raises(WireError, match=error):
        trtllm.decode_message([b"trtllm", bytes(8), json.dumps(event).encode()])


def test_iteration_stats_give_the_load_and_an_idle_engine_keeps_its_usage():
    stats = [
        {"numActiveRequests": 9},
        {
            "numActiveRequests": 2,
            "numQueuedRequests": 1,
            "inflightBatchingStats": {"numPausedRequests": 3},
            "kvCacheStats": {"maxNumBlocks": 1000, "usedNumBlocks": 250, "tokensPerBlock": 32},
        },
    ]
    assert parse_iteration_stats(stats, 16) == (WorkerLoad(2, 4, 0.25, 2000), "")
    assert parse_iteration_stats([], 16, last_usage=0.25) == (WorkerLoad(0, 0, 0.25), "")
    assert parse_iteration_stats({"a": 1}, 16) == (None, "not a JSON list of iteration stats")
    assert parse_iteration_stats([{"numActiveRequests": -1, "numQueuedRequests": 0}], 16)[0] is None


def decode_or_reject(frames: list[bytes], pages: PageBlocks, translator: Translator) -> EventBatch | None:
    try:
        batch = trtllm.decode_message(frames)
    except WireError:
        return None
    except Exception as exc:  # the property under test: nothing but WireError
        pytest.fail(f"{type(exc).__name__}: {exc} on frames {[f.hex() for f in frames]}")
    translator.translate(pages.translate(batch.events))
    return batch


def test_mutated_tensorrt_llm_events_decode_or_raise_wire_error():
    rng = random.Random(31)
    pages, translator = PageBlocks(16), Translator(16)
    accepted = 0
    for _ in range(MUTATED_FRAMES):
        frames = frames_of(rng.choice(EVENTS))
        if rng.random() < 0.5:  # the JSON's values: swap a number, a type or a structure for another
            text = frames[2].decode()
            at = rng.randrange(len(text))
            text = (
                text[:at]
                + rng.choice(["-1", "null", '"x"', "[]", "{}", "1e400", "18446744073709551616", "0"])
                + text[at + rng.randint(0, 6) :]
            )
            frames[2] = text.encode("utf-8", "surrogatepass")
        else:
            frames[2] = mutate_bytes(rng, frames[2])
        accepted += decode_or_reject(frames, pages, translator) is not None
    assert 0 < accepted < MUTATED_FRAMES
