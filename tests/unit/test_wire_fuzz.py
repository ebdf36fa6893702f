"""Fuzzing the KV-event decoder (kvevents/vllm.py) with generated and mutated frames.

Properties, for every frame:
- ``decode_message`` returns a batch or raises :class:`WireError`, nothing else;
- a batch it returns is well typed (what the translator relies on) and the translator takes it;
- a valid vLLM batch decodes to exactly the events its generator meant (map and positional
  encodings, int and 32-byte hashes, signed hashes, unknown types and keys);
- the agent counts every rejected frame: ``EventPipeline.decode`` returns None for it and adds
  one to ``decode_errors`` (a wrong topic goes to ``wrong_topic`` instead).

Frames: 100,000 mutations of the real vLLM 0.32 captures (bit flips, truncations, splices,
insertions, deletions, frame-level damage) from a seeded generator, plus hypothesis-generated
batches (valid ones, and ones with wrong types, missing and extra fields, out-of-range ints, huge
lists, wrong tags) and raw bytes: 900 examples by default, 102,000 with
``KVROUTE_WIRE_FUZZ_EXAMPLES=34000`` (an environment variable, not the ``slow`` marker: slow tests
are in the default run, and these take many minutes).
"""

from __future__ import annotations

import os
import random
import struct
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvevents.vllm import (
    MAX_TOKEN_ID,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    WireError,
    decode_message,
)
from tests.unit.test_wire import CAPTURE_NAMES, raw_messages
from worker_agent.metrics import AgentCounters, new_registry
from worker_agent.pipeline import EventPipeline
from worker_agent.translate import Translator

MUTATED_FRAMES = 100_000
# Per hypothesis test (three of them); KVROUTE_WIRE_FUZZ_EXAMPLES=34000 runs 102,000 (33 min on 2
# busy cores: about 10 ms per generated batch, most of it in hypothesis).
EXAMPLES = int(os.environ.get("KVROUTE_WIRE_FUZZ_EXAMPLES", "300"))
U64_MASK = (1 << 64) - 1
STORED_ORDER = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name")
STORED_ORDER += ("extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality")
STORED_ORDER += ("ownership", "session_id", "lookahead_token_ids")
REMOVED_ORDER = ("block_hashes", "medium", "group_idx", "locality", "ownership")
CAPTURED = [frames for name in CAPTURE_NAMES for frames in raw_messages(name)]


def decode_or_reject(frames: list[bytes]) -> EventBatch | None:
    """The batch, or None for a WireError; any other exception fails the test with the frame."""
    try:
        batch = decode_message(frames)
    except WireError:
        return None
    except Exception as exc:  # the property under test: nothing but WireError
        pytest.fail(f"{type(exc).__name__}: {exc} on frames {[f.hex() for f in frames]}")
    assert_well_typed(batch)
    return batch


def assert_well_typed(batch: EventBatch) -> None:
    assert isinstance(batch.topic, str) and 0 <= batch.seq <= U64_MASK and isinstance(batch.ts, float)
    assert batch.dp_rank is None or type(batch.dp_rank) is int
    assert all(isinstance(key, str) for key in batch.unknown_keys)
    for event in batch.events:
        if isinstance(event, AllBlocksCleared):
            continue
        assert all(is_engine_hash(h) for h in event.block_hashes)
        assert event.medium is None or isinstance(event.medium, str)
        assert event.group_idx is None or type(event.group_idx) is int
        if isinstance(event, BlockRemoved):
            assert event.block_hashes
        if isinstance(event, BlockStored):
            assert type(event.block_size) is int and event.block_size > 0
            spanned = len(event.block_hashes) * event.block_size
            if event.kv_cache_spec_kind in (None, "full_attention"):
                assert event.block_hashes and len(event.token_ids) == spanned
            else:  # a window group's store: its span's tokens, some (or none) of its blocks stored
                assert event.token_ids and len(event.token_ids) % event.block_size == 0
                assert len(event.token_ids) >= spanned
            assert all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in event.token_ids)
            assert event.parent_block_hash is None or is_engine_hash(event.parent_block_hash)
            assert event.lora_name is None or isinstance(event.lora_name, str)
            assert event.extra_keys is None or isinstance(event.extra_keys, tuple)
    Translator().translate(batch.events)  # what the agent does next must not raise either


def is_engine_hash(value: Any) -> bool:
    return isinstance(value, bytes) or (type(value) is int and 0 <= value <= U64_MASK)


def new_pipeline() -> tuple[EventPipeline, AgentCounters]:
    """The agent's decode step; it never reaches the writer or the replay client."""
    counters = AgentCounters()
    return EventPipeline(None, None, "kv", counters, new_registry()[1]), counters  # type: ignore[arg-type]


# --- mutated real captures (seeded, default run) -------------------------------------------------


def mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    kind = rng.randrange(6)
    if kind == 0 and out:  # bit flips
        for _ in range(rng.randint(1, 8)):
            out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
    elif kind == 1:  # truncation
        del out[rng.randrange(len(out) + 1) :]
    elif kind == 2 and out:  # one byte replaced
        out[rng.randrange(len(out))] = rng.randrange(256)
    elif kind == 3:  # bytes inserted
        at = rng.randrange(len(out) + 1)
        out[at:at] = rng.randbytes(rng.randint(1, 4))
    elif kind == 4:  # bytes deleted
        at = rng.randrange(len(out) + 1)
        del out[at : at + rng.randint(1, 8)]
    else:  # spliced with another capture's tail
        other = rng.choice(CAPTURED)[2]
        out = out[: rng.randrange(len(out) + 1)] + other[rng.randrange(len(other) + 1) :]
    return bytes(out)


def mutate_message(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    frames = list(frames)
    roll = rng.random()
    if roll < 0.9:
        frames[2] = mutate_bytes(rng, frames[2])
    elif roll < 0.95:
        which = rng.randrange(2)
        frames[which] = mutate_bytes(rng, frames[which])
    elif roll < 0.98:
        del frames[rng.randrange(3)]
    else:
        frames.insert(rng.randrange(4), rng.randbytes(rng.randrange(9)))
    return frames


def huge_frames() -> list[list[bytes]]:
    """Large lists: 200,000 hashes with too few tokens, and 60,000 tokens stored in one event."""
    many = list(range(200_000))
    bad = {"type": "BlockStored", "block_hashes": many, "parent_block_hash": None, "token_ids": [1], "block_size": 1}
    good = {"type": "BlockStored", "block_hashes": many[:1000], "token_ids": [7] * 60_000, "block_size": 60}
    removed = {"type": "BlockRemoved", "block_hashes": many}
    return [[b"kv", bytes(8), msgpack.packb([1.0, events, 0])] for events in ([bad], [good], [removed] * 3)]


def test_mutated_captures_decode_or_raise_wire_error_and_every_rejection_is_counted():
    rng = random.Random(13)
    pipeline, counters = new_pipeline()
    rejected = wrong_topic = accepted = 0
    for n in range(MUTATED_FRAMES):
        frames = mutate_message(rng, rng.choice(CAPTURED))
        batch = decode_or_reject(frames)
        if n % 10 == 0:  # the agent's own path on a tenth of them (the whole run stays a few seconds)
            assert (pipeline.decode(frames) is None) == (batch is None or not batch.topic.startswith("kv"))
            rejected += batch is None
            wrong_topic += batch is not None and not batch.topic.startswith("kv")
        accepted += batch is not None
    for frames in huge_frames():
        decode_or_reject(frames)
    assert counters.decode_errors == rejected > 0 and counters.wrong_topic == wrong_topic
    assert 0 < accepted < MUTATED_FRAMES  # both outcomes were exercised


def test_a_single_bit_flip_in_a_real_frame_no_longer_crashes_the_decoder():
    """Found by the test above: byte 10 of the first run1 message xor 0x10 makes a map key that is
    itself a map; msgpack raised TypeError (unhashable type: 'dict'), not a WireError."""
    frames = list(raw_messages("run1_events")[0])
    payload = bytearray(frames[2])
    payload[10] ^= 0x10
    with pytest.raises(WireError, match="not valid msgpack"):
        decode_message([frames[0], frames[1], bytes(payload)])
    pipeline, counters = new_pipeline()
    assert pipeline.decode([frames[0], frames[1], bytes(payload)]) is None and counters.decode_errors == 1


def test_every_valid_capture_still_decodes_through_the_pipeline():
    pipeline, counters = new_pipeline()
    assert all(pipeline.decode(frames) is not None for frames in CAPTURED)
    assert counters.decode_errors == 0


# --- generated batches (hypothesis) ---------------------------------------------------------------

engine_hashes = st.one_of(st.integers(-(1 << 63), U64_MASK), st.binary(min_size=32, max_size=32))


def u32_lists(count: int) -> st.SearchStrategy[list[int]]:
    """``count`` token ids in one draw (drawn one by one, generation dominated the run time)."""
    return st.binary(min_size=4 * count, max_size=4 * count).map(lambda data: list(struct.unpack(f">{count}I", data)))


short_text = st.text(max_size=6)
msgpack_ints = st.integers(-(1 << 63), U64_MASK)  # what msgpack can encode
scalars = st.one_of(
    st.none(),
    st.booleans(),
    msgpack_ints,
    st.floats(),
    short_text,
    st.binary(max_size=40),
    st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=12)),
    st.builds(msgpack.Timestamp, st.integers(0, (1 << 34) - 1), st.integers(0, 999_999_999)),
)
anything = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(short_text | msgpack_ints, inner, max_size=3)
)


def expected_hash(value: int | bytes) -> int | bytes:
    return value & U64_MASK if isinstance(value, int) else value


@st.composite
def stored_fields(draw: st.DrawFn) -> dict[str, Any]:
    blocks, block_size = draw(st.integers(1, 4)), draw(st.integers(1, 16))
    per_block_keys = st.none() | st.lists(short_text | st.integers(0, 99), max_size=2)
    return {
        "block_hashes": draw(st.lists(engine_hashes, min_size=blocks, max_size=blocks)),
        "parent_block_hash": draw(st.none() | engine_hashes),
        "token_ids": draw(u32_lists(blocks * block_size)),
        "block_size": block_size,
        "lora_id": draw(st.none() | st.integers(0, 9)),
        "medium": draw(st.none() | st.sampled_from(["GPU", "CPU", "disk"])),
        "lora_name": draw(st.none() | short_text),
        "extra_keys": draw(st.none() | st.lists(per_block_keys, min_size=blocks, max_size=blocks)),
        "group_idx": draw(st.none() | st.integers(0, 3)),
        "kv_cache_spec_kind": draw(st.sampled_from(["full_attention", "sliding_window"])),
    }


removed_fields = st.fixed_dictionaries(
    {
        "block_hashes": st.lists(engine_hashes, min_size=1, max_size=6),
        "medium": st.none() | st.sampled_from(["GPU", "CPU"]),
        "group_idx": st.none() | st.integers(0, 3),
    }
)
known_events = st.one_of(
    st.tuples(st.just("BlockStored"), stored_fields()),
    st.tuples(st.just("BlockRemoved"), removed_fields),
    st.tuples(st.just("AllBlocksCleared"), st.just({})),
)


def expected_event(kind: str, fields: dict[str, Any]) -> Any:
    """The event a sender of these fields means (an independent model of the decoder)."""
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    hashes = tuple(expected_hash(h) for h in fields["block_hashes"])
    if kind == "BlockRemoved":
        later = {name: fields[name] for name in REMOVED_ORDER[3:] if name in fields}
        return BlockRemoved(hashes, medium=fields.get("medium"), group_idx=fields.get("group_idx"), **later)
    parent, extra = fields.get("parent_block_hash"), fields.get("extra_keys")
    later = {name: fields[name] for name in STORED_ORDER[10:] if name in fields}  # sent only when set
    return BlockStored(
        hashes,
        None if parent is None else expected_hash(parent),
        tuple(fields["token_ids"]),
        fields["block_size"],
        lora_id=fields.get("lora_id"),
        medium=fields.get("medium"),
        lora_name=fields.get("lora_name"),
        extra_keys=None if extra is None else tuple(extra),
        group_idx=fields.get("group_idx"),
        kv_cache_spec_kind=fields.get("kv_cache_spec_kind"),
        **later,
    )


ALL_FIELD_NAMES = {"type", *STORED_ORDER, *REMOVED_ORDER}
unknown_names = short_text.filter(lambda name: name not in ALL_FIELD_NAMES)


@st.composite
def encoded_events(draw: st.DrawFn) -> tuple[Any, Any, set[str]]:
    """(wire form, expected event or None for an unknown type, unknown keys), either encoding."""
    if draw(st.integers(0, 9)) == 0:
        kind = draw(short_text.filter(lambda k: k not in ("BlockStored", "BlockRemoved", "AllBlocksCleared")))
        return {"type": kind, **draw(st.dictionaries(unknown_names, anything, max_size=3))}, None, set()
    kind, fields = draw(known_events)
    if draw(st.booleans()):  # the older positional encoding: a prefix of the fields in vLLM's order
        order = {"BlockStored": STORED_ORDER, "BlockRemoved": REMOVED_ORDER}.get(kind, ())
        length = draw(st.integers(min(len(order), 4 if kind == "BlockStored" else 1), len(order)))
        sent = {name: fields.get(name) for name in order[:length]}
        return [kind, *sent.values()], expected_event(kind, sent), set()
    extra = draw(st.dictionaries(unknown_names, anything, max_size=2))
    return {"type": kind, **fields, **extra}, expected_event(kind, fields), set(extra)


def payload_of(draw: st.DrawFn, events: list[Any]) -> tuple[bytes, float, int | None]:
    ts = draw(st.floats(allow_nan=False) | st.integers(0, 1 << 40))
    dp_rank = draw(st.none() | st.integers(0, 7))
    batch = [ts, events] if dp_rank is None and draw(st.booleans()) else [ts, events, dp_rank]
    return msgpack.packb(batch, use_bin_type=True), float(ts), dp_rank


@st.composite
def valid_messages(draw: st.DrawFn) -> tuple[list[bytes], list[Any], int, set[str]]:
    encoded = draw(st.lists(encoded_events(), max_size=5))
    payload, ts, dp_rank = payload_of(draw, [wire for wire, _, _ in encoded])
    seq = draw(st.integers(0, U64_MASK))
    expected = [event for _, event, _ in encoded if event is not None]
    unknown_keys = set().union(*(keys for _, _, keys in encoded))
    frames = [b"kv", seq.to_bytes(8, "big"), payload]
    return frames, [ts, expected, dp_rank, seq], len(encoded) - len(expected), unknown_keys


def corrupt(draw: st.DrawFn, wire: Any) -> Any:
    """One defect: a field of any type, a field missing or added, a wrong tag, a huge list."""
    if isinstance(wire, list):  # positional: any element (the tag too) replaced, or one more
        at = draw(st.integers(0, len(wire)))
        return [*wire[:at], draw(anything), *wire[at + draw(st.integers(0, 1)) :]]
    defect = draw(st.sampled_from(["value", "missing", "extra", "tag", "huge", "not-a-map"]))
    if defect == "value":
        wire[draw(st.sampled_from(sorted(wire)))] = draw(anything)
    elif defect == "missing":
        wire.pop(draw(st.sampled_from(sorted(wire))))
    elif defect == "extra":
        wire[draw(short_text | msgpack_ints)] = draw(anything)
    elif defect == "tag":
        wire["type"] = draw(anything)
    elif defect == "huge":
        item = draw(st.sampled_from([0, U64_MASK, -1, None, "x", MAX_TOKEN_ID + 1]))
        wire[draw(st.sampled_from(["block_hashes", "token_ids", "extra_keys"]))] = [item] * draw(st.integers(0, 5000))
    else:
        return draw(anything)
    return wire


@st.composite
def corrupted_messages(draw: st.DrawFn) -> list[bytes]:
    encoded = [wire for wire, _, _ in draw(st.lists(encoded_events(), min_size=1, max_size=4))]
    at = draw(st.integers(0, len(encoded) - 1))
    encoded[at] = corrupt(draw, encoded[at])
    outer = draw(st.sampled_from(["ok", "ts", "events", "rank", "shape"]))
    if outer == "ok":
        payload = payload_of(draw, encoded)[0]
    elif outer == "shape":
        payload = msgpack.packb(draw(anything))
    else:
        batch = [1.0, encoded, 0]
        batch[["ts", "events", "rank"].index(outer)] = draw(anything)
        payload = msgpack.packb(batch)
    return [b"kv", draw(st.integers(0, U64_MASK)).to_bytes(8, "big"), payload]


raw_frames = st.lists(st.binary(max_size=64), min_size=0, max_size=5) | st.tuples(
    st.sampled_from([b"kv", b"\xff", b""]), st.binary(min_size=7, max_size=9), st.binary(max_size=200)
).map(list)


def check_valid(message: tuple[list[bytes], list[Any], int, set[str]]) -> None:
    frames, (ts, expected, dp_rank, seq), unknown_events, unknown_keys = message
    batch = decode_or_reject(frames)
    assert batch is not None
    assert (batch.topic, batch.seq, batch.ts, batch.dp_rank) == ("kv", seq, ts, dp_rank)
    assert list(batch.events) == expected
    assert batch.unknown_events == unknown_events and batch.unknown_keys == unknown_keys


def check_any(frames: list[bytes]) -> None:
    batch = decode_or_reject(frames)
    pipeline, counters = new_pipeline()
    decoded = pipeline.decode(frames)
    assert (decoded is None) == (batch is None or not batch.topic.startswith("kv"))
    assert counters.decode_errors == (batch is None)


LARGE_INPUTS = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=LARGE_INPUTS)


@FUZZ
@given(valid_messages())
def test_valid_batches_decode_to_what_was_sent(message):
    check_valid(message)


@FUZZ
@given(corrupted_messages())
def test_corrupted_batches_decode_or_raise_wire_error_and_are_counted(frames):
    check_any(frames)


@FUZZ
@given(raw_frames)
def test_raw_bytes_decode_or_raise_wire_error_and_are_counted(frames):
    check_any(frames)
