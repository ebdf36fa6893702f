"""Golden decoding of every message a real vLLM 0.32 server published (tests/fixtures captures),
plus the older positional encoding and malformed input."""

from __future__ import annotations

import json
import re

import msgpack
import pytest

from kvevents.vllm import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    WireError,
    decode_message,
)
from tests.conftest import CAPTURES

CAPTURE_NAMES = ["run1_events", "run2_evict_events", "run3_cbor_bytes_events", "run4_lora_events"]


def raw_messages(name: str) -> list[list[bytes]]:
    """The frames of each message, from the hex dump in <name>.txt."""
    messages: list[list[bytes]] = []
    for line in (CAPTURES / f"{name}.txt").read_text().splitlines():
        if line.startswith("--- msg #"):
            messages.append([])
        match = re.match(r"\s+frame\[\d+\] len=\d+ hex=([0-9a-f]*)$", line)
        if match:
            messages[-1].append(bytes.fromhex(match.group(1)))
    return messages


def expected_hash(value):
    return bytes.fromhex(value["__bytes_hex__"]) if isinstance(value, dict) else value


@pytest.mark.parametrize("name", CAPTURE_NAMES)
def test_every_captured_message_decodes_exactly(name):
    decoded_lines = [json.loads(line) for line in (CAPTURES / f"{name}.jsonl").read_text().splitlines()]
    messages = raw_messages(name)
    assert len(messages) == len(decoded_lines) > 0
    for frames, expected in zip(messages, decoded_lines, strict=True):
        batch = decode_message(frames)
        ts, events, dp_rank = expected["payload"]
        assert (batch.topic, batch.seq, batch.ts, batch.dp_rank) == (expected["topic"], expected["seq"], ts, dp_rank)
        assert batch.unknown_events == 0 and batch.unknown_keys == frozenset()
        assert len(batch.events) == len(events)
        for event, want in zip(batch.events, events, strict=True):
            hashes = tuple(expected_hash(h) for h in want.get("block_hashes", ()))
            if want["type"] == "BlockStored":
                assert isinstance(event, BlockStored)
                assert event.block_hashes == hashes
                parent = want["parent_block_hash"]
                assert event.parent_block_hash == (None if parent is None else expected_hash(parent))
                assert list(event.token_ids) == want["token_ids"]
                assert event.block_size == want["block_size"] and event.medium == want["medium"]
                assert list(event.extra_keys or []) == want["extra_keys"]
            elif want["type"] == "BlockRemoved":
                assert isinstance(event, BlockRemoved) and event.block_hashes == hashes
            else:
                assert isinstance(event, AllBlocksCleared)


def frames_for(events, seq=5) -> list[bytes]:
    return [b"kv", seq.to_bytes(8, "big"), msgpack.packb([1.5, events, 0])]


def removed_with(**fields):
    return {"type": "BlockRemoved", "block_hashes": [3], **fields}


def stored_with(**fields):
    base = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [5, 6]}
    return {**base, "block_size": 2, **fields}


def test_the_older_positional_encoding_is_accepted():
    batch = decode_message(
        frames_for(
            [
                ["BlockStored", [11, 12], None, list(range(8)), 4, None, "GPU"],
                ["BlockRemoved", [12], "GPU"],
                ["AllBlocksCleared"],
            ]
        )
    )
    stored, removed, cleared = batch.events
    assert stored == BlockStored((11, 12), None, tuple(range(8)), 4, lora_id=None, medium="GPU")
    assert removed == BlockRemoved((12,), "GPU") and cleared == AllBlocksCleared()


def test_unknown_types_and_keys_are_counted_and_skipped():
    batch = decode_message(
        frames_for([{"type": "BlockTouched", "x": 1}, {"type": "BlockRemoved", "block_hashes": [3], "future": 1}])
    )
    assert batch.unknown_events == 1 and batch.unknown_keys == {"future"}
    assert batch.events == (BlockRemoved((3,), None),)


@pytest.mark.parametrize(
    ("frames", "message"),
    [
        ([b"kv", b"\0" * 8], "3 frames"),
        ([b"kv", b"\0" * 7, msgpack.packb([1.0, [], 0])], "8 bytes"),
        ([b"kv", b"\0" * 8, b"\xc1garbage"], "not valid msgpack"),
        ([b"kv", b"\0" * 8, msgpack.packb({"a": 1})], "must be an array"),
        (frames_for([stored_with(block_size=4)]), "2 token ids for 1 blocks of 4"),
        (frames_for([{k: v for k, v in stored_with().items() if k != "parent_block_hash"}]), "parent_block_hash"),
        (frames_for([{"type": "BlockRemoved", "block_hashes": []}]), r"length >= 1 - at `\$.block_hashes`"),
        (frames_for([{"type": "BlockRemoved", "block_hashes": ["x"]}]), r"Expected `int \| bytes`, got `str`"),
        (frames_for([42]), "map or a tagged array"),
        ([b"\xff", b"\0" * 8, msgpack.packb([1.0, [], 0])], "utf-8"),
        # found by tests/unit/test_wire_fuzz.py: map keys that are arrays or maps raised TypeError
        ([b"kv", b"\0" * 8, b"\x81\x91\x01\x02"], "must be an array"),
        (frames_for([{"type": "BlockRemoved", "block_hashes": ["AAAA"]}]), r"got `str` - at `\$.block_hashes\[0\]`"),
        ([b"kv", b"\0" * 8, b"\x81\x80\x01"], "not valid msgpack"),
        # wrong types were read as "absent": a bool as a token id, a misread tier or LoRA name
        (frames_for([stored_with(token_ids=[True], block_size=1)]), r"got `bool` - at `\$.token_ids\[0\]`"),
        (frames_for([stored_with(token_ids=[5, 1 << 32])]), r"<= 4294967295 - at `\$.token_ids\[1\]`"),
        (frames_for([removed_with(medium=1)]), r"BlockRemoved: Expected `str \| null`, got `int` - at `\$.medium`"),
        (frames_for([removed_with(group_idx="0")]), r"Expected `int \| null`, got `str` - at `\$.group_idx`"),
        (frames_for([stored_with(lora_name=["a"])]), r"at `\$.lora_name`"),
        (frames_for([stored_with(extra_keys="salt")]), r"Expected `array \| null`, got `str` - at `\$.extra_keys`"),
        # a window group's store may name no block of its span, but it has a span
        (frames_for([stored_with(block_hashes=[], token_ids=[], kv_cache_spec_kind="sliding_window")]), "no block"),
        (frames_for([stored_with(block_hashes=[], token_ids=[5])]), "no block"),
    ],
)
def test_malformed_messages_raise_a_clear_wire_error(frames, message):
    with pytest.raises(WireError, match=message):
        decode_message(frames)


def test_dynamo_s_tensorrt_llm_publisher_speaks_vllm_s_wire_and_its_multimodal_blocks_are_not_text():
    """Dynamo's TensorRT-LLM worker pushes vLLM-shaped events over ZMQ (signed hashes, no medium),
    with ``block_mm_infos`` for blocks that hold images: those must never match a text prompt."""
    from kvevents.vllm import decode_payload
    from worker_agent.translate import Translator

    plain = {
        "type": "BlockStored",
        "block_hashes": [-2],
        "parent_block_hash": None,
        "token_ids": [1] * 4,
        "block_size": 4,
    }
    image = {**plain, "block_hashes": [-3, 4], "token_ids": [1] * 8, "block_mm_infos": [None, {"mm_hashes": ["ab"]}]}
    _, events, _, _, unknown = decode_payload(msgpack.packb([1.0, [plain, image], 0]))
    assert unknown == set() and events[1].extra_keys == (None, [{"multimodal": True}])
    translator = Translator(4)
    batch = translator.translate(events)
    assert len(batch.changes) == 1 and translator.counters.unsupported_extra_keys == 1
