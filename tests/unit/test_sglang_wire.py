"""SGLang's KV-event wire (kvevents/sglang.py): what SGLang's own code sent (tests/fixtures/sglang/)
decodes, malformed input is a WireError and nothing else, and 100,000 mutated frames never crash
the decoder, the page re-blocking or the translation behind it."""

from __future__ import annotations

import random

import msgpack
import pytest

from kvevents import sglang
from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, WireError
from tests.support.captures import sglang_messages
from tests.unit.test_wire_fuzz import MUTATED_FRAMES, mutate_bytes
from worker_agent.engine_kinds import KINDS, SGLANG
from worker_agent.metrics import AgentCounters, new_registry
from worker_agent.pages import PageBlocks
from worker_agent.pipeline import EventPipeline
from worker_agent.translate import Translator

NAMES = ("sglang-0.5.23-page1", "sglang-0.5.23-page16", "sglang-0.4.9-page4")
LIVE = [frames for name in NAMES for frames in sglang_messages(name)]
REPLAYED = [frames for name in NAMES for frames in sglang_messages(name, "replay")]


def message(*events: object, rank: int | None = 0) -> list[bytes]:
    batch = [1.5, list(events)] + ([rank] if rank is not None else [])
    return [b"kv", (7).to_bytes(8, "big"), msgpack.packb(batch)]


def stored(**fields: object) -> dict[str, object]:
    base = {
        "type": "BlockStored",
        "block_hashes": [-5],
        "parent_block_hash": None,
        "token_ids": [1, 2],
        "block_size": 2,
    }
    return {**base, "lora_id": None, **fields}


def test_every_message_sglang_sent_decodes_and_replays_decode_alike():
    for name in NAMES:
        live, replayed = sglang_messages(name), sglang_messages(name, "replay")
        assert len(live) == len(replayed) == (9 if "0.5.23" in name else 4)
        for frames, again in zip(live, replayed, strict=True):
            batch, copy = sglang.decode_message(frames), sglang.decode_message(again, "kv")
            assert (batch.topic, batch.seq, batch.events) == (copy.topic, copy.seq, copy.events) and batch.topic == "kv"
            assert not batch.unknown_keys and not batch.unknown_events


def test_sglang_fields_become_the_typed_events():
    batch = sglang.decode_message(
        message(
            stored(medium="CPU_PINNED", cache_salt="s1", session_id="chat-9", lora_name="ad"),
            stored(parent_block_hash=-5, block_hashes=[6], token_ids=[3, 4], cache_salt="s1"),
            {"type": "BlockRemoved", "block_hashes": [-5], "medium": "GPU"},
            {"type": "AllBlocksCleared"},
            {"type": "SomethingNew", "x": 1},
        )
    )
    first, second, removed, cleared = batch.events
    assert isinstance(first, BlockStored) and first.block_hashes == ((1 << 64) - 5,)  # int64 as its 64 bits
    assert (first.medium, first.lora_name, first.extra_keys) == ("CPU_PINNED", "ad", (["s1"],))
    assert isinstance(second, BlockStored) and second.extra_keys is None  # a continuation: its chain carries the salt
    assert isinstance(removed, BlockRemoved) and isinstance(cleared, AllBlocksCleared)
    assert batch.unknown_events == 1 and batch.dp_rank == 0


def test_blocks_the_router_cannot_hash_are_counted_by_reason_not_decoded():
    batch = sglang.decode_message(
        message(stored(token_ids=[[1, 2], [2, 3]], block_hashes=[1, 2], block_size=1), stored(lora_id=3))
    )
    assert batch.events == () and batch.unreproducible == {sglang.EAGLE_BIGRAMS: 2, sglang.UNNAMED_LORA: 1}
    assert sglang.decode_message(message(stored(lora_id=3, lora_name="ad"))).unreproducible == {}


@pytest.mark.parametrize(
    "frames, error",
    [
        (message(stored(cache_salt=5)), "cache_salt must be a string"),
        (message(stored(session_id=[1])), "session_id must be a string"),
        (message(stored(token_ids=[1])), "1 token ids for 1 blocks of 2"),
        (message(stored(token_ids=[[1, 2], [3]], block_size=2)), "BlockStored"),
        (message(stored(block_hashes=[], token_ids=[[1, 2]])), "block_hashes must be a non-empty array"),
        (message(["BlockStored", [1], None, [1], 1, None, None, None, None, None, "extra"]), "at most 9"),
        (message({"block_hashes": [1]}), "no string 'type'"),
        ([b"kv", b"\x00" * 8, b"\xc1"], "not valid msgpack"),
        ([b"kv", b"\x00" * 7, msgpack.packb([1.0, []])], "seq frame must be 8 bytes"),
        ([b"\xff", b"\x00" * 8, msgpack.packb([1.0, []])], "not utf-8"),
        ([msgpack.packb([1.0, []])], "3 frames"),
        ([b"kv", b"\x00" * 8, msgpack.packb(["now", []])], "timestamp must be a number"),
    ],
)
def test_malformed_input_is_a_wire_error_that_says_what_is_wrong(frames, error):
    with pytest.raises(WireError, match=error):
        sglang.decode_message(frames)


def new_pipeline() -> tuple[EventPipeline, AgentCounters]:
    counters = AgentCounters()
    pipeline = EventPipeline(None, None, "kv", counters, new_registry()[1])  # type: ignore[arg-type]
    pipeline.set_engine_kind(KINDS[SGLANG], 16)
    return pipeline, counters


def decode_or_reject(frames: list[bytes], pages: PageBlocks, translator: Translator) -> EventBatch | None:
    try:
        batch = sglang.decode_message(frames, "kv")
    except WireError:
        return None
    except Exception as exc:  # the property under test: nothing but WireError
        pytest.fail(f"{type(exc).__name__}: {exc} on frames {[f.hex() for f in frames]}")
    translator.translate(pages.translate(batch.events))  # what the agent does next must not raise either
    return batch


def test_mutated_sglang_frames_decode_or_raise_wire_error_and_every_rejection_is_counted():
    rng = random.Random(29)
    pipeline, counters = new_pipeline()
    pages, translator = PageBlocks(16), Translator(16)
    rejected = accepted = 0
    for n in range(MUTATED_FRAMES):
        frames = list(rng.choice(LIVE if n % 4 else REPLAYED))
        at = len(frames) - 1 if rng.random() < 0.9 else rng.randrange(len(frames))
        frames[at] = mutate_bytes(rng, frames[at])
        if rng.random() < 0.02:
            del frames[rng.randrange(len(frames))]
        batch = decode_or_reject(frames, pages, translator)
        if n % 10 == 0:  # the agent's own path on a tenth of them
            wrong_topic = batch is not None and not batch.topic.startswith("kv")
            assert (pipeline.decode(frames) is None) == (batch is None or wrong_topic)
            rejected += batch is None
        accepted += batch is not None
    assert counters.decode_errors == rejected > 0
    assert 0 < accepted < MUTATED_FRAMES


def test_the_agent_says_once_per_reason_what_it_cannot_hash_and_counts_every_block(caplog):
    pipeline, counters = new_pipeline()
    bigrams = stored(token_ids=[[1, 2], [2, 3]], block_hashes=[1, 2], block_size=1)
    for _ in range(3):
        assert pipeline.decode(message(bigrams, stored(lora_id=4))) is not None
    assert counters.unreproducible_blocks == {sglang.EAGLE_BIGRAMS: 6, sglang.UNNAMED_LORA: 3}
    said = [r.getMessage() for r in caplog.records if "cannot hash" in r.getMessage()]
    assert len(said) == 2 and any("EAGLE" in line for line in said) and any("LoRA" in line for line in said)


def test_the_one_pass_decode_and_the_field_by_field_one_agree_on_every_message_sglang_sent():
    strict_ones = 0
    for frames in LIVE:
        strict = sglang._decode_strictly(frames[2])
        lenient = sglang._decode_leniently(frames[2])
        if strict is not None:
            strict_ones += 1
            assert strict[1] == lenient[1] and strict[2] == lenient[2]
        else:  # only what needs counting by reason, or an older release's positional events
            assert lenient[5] or any(isinstance(raw, list) for raw in msgpack.unpackb(frames[2])[1])
    assert strict_ones >= 16  # 0.5.23's messages but the EAGLE ones
