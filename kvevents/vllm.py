"""vLLM's KV-event wire format: one msgspec schema, decoded by the agent, encoded by the sim engine.

A message is three ZMQ frames: topic (utf-8), seq (8 bytes big-endian) and a msgpack payload
``[ts, events, data_parallel_rank]``. Events are maps tagged by "type" (vLLM >= ~0.26) or, in
older versions, positional arrays ``["BlockStored", ...]`` in the schema's field order; both are
accepted. Block hashes are uint64 by default, or 32-byte strings with
VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0.

Decoding is strict first: one msgspec pass straight into the structs, which is what every vLLM
0.32/0.33 message takes. A message that pass refuses (an unknown event type or key, the positional
encoding, a longer payload, or a defect) is read again leniently: unknown types and keys are
counted and skipped, and the known fields are validated by the same structs. Anything malformed
(a wrong type in a field we use, too: a misread ``medium`` or ``lora_name`` would credit blocks to
the wrong tier or prefix) raises :class:`WireError` and nothing else; tests/unit/test_wire_fuzz.py
holds that over generated and mutated frames. docs/sim-engine.md, "The KV-event wire", and the
real captures in tests/fixtures/ say where each field comes from.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import msgspec

from kvevents.events import (
    FIELDS,
    MAX_TOKEN_ID,
    REPLAY_END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineHash,
    Event,
    EventBatch,
    WireError,
    convert_event,
    decode_seq,
    decode_topic,
    event_fields,
    generic_batch,
)

__all__ = [
    "MAX_TOKEN_ID",
    "REPLAY_END_SEQ",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EngineHash",
    "Event",
    "EventBatch",
    "WireError",
    "decode_message",
    "decode_payload",
    "decode_seq",
    "encode_payload",
    "encode_seq",
]


class _Payload(msgspec.Struct, array_like=True):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


_STRICT = msgspec.msgpack.Decoder(_Payload)
_ENCODER = msgspec.msgpack.Encoder()


# --- encoding (the simulated engine) --------------------------------------------------------------


def encode_payload(events: Sequence[Event], dp_rank: int = 0, ts: float | None = None) -> bytes:
    return _ENCODER.encode(_Payload(time.time() if ts is None else ts, list(events), dp_rank))


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


# --- decoding (the agent) -------------------------------------------------------------------------


def decode_event(raw: Any) -> tuple[Event | None, set[str]]:
    """One event from its generic msgpack form, or None for an unknown type; also the keys this
    schema does not know (skipped)."""
    kind, fields = event_fields(raw, FIELDS)
    media = fields.pop("block_mm_infos", None)
    if isinstance(media, list) and any(media) and "extra_keys" not in fields:
        # Dynamo's TensorRT-LLM publisher sends vLLM's wire with multimodal blocks described here:
        # as extra keys (a map, which no prompt's hash reproduces) they are never indexed as text
        fields["extra_keys"] = [[{"multimodal": True}] if info else None for info in media]
    return convert_event(kind, fields)


def _decode_leniently(payload: bytes) -> tuple[float, list[Event], int | None, int, set[str]]:
    ts, raws, dp_rank = generic_batch(payload, "data_parallel_rank")
    events: list[Event] = []
    unknown_events = 0
    unknown_keys: set[str] = set()
    for raw in raws:
        event, extra = decode_event(raw)
        unknown_keys |= extra
        if event is None:
            unknown_events += 1
        else:
            events.append(event)
    return ts, events, dp_rank, unknown_events, unknown_keys


def decode_payload(payload: bytes) -> tuple[float, list[Event], int | None, int, set[str]]:
    """(ts, events, dp_rank, unknown event count, unknown keys)."""
    try:
        strict = _STRICT.decode(payload)
    except msgspec.DecodeError:  # also ValidationError: anything unusual goes the lenient way
        return _decode_leniently(payload)
    return float(strict.ts), strict.events, strict.data_parallel_rank, 0, set()


def decode_message(frames: list[bytes]) -> EventBatch:
    """A PUB message (or a replayed one, without its leading empty frame) -> EventBatch."""
    if len(frames) != 3:
        raise WireError(f"a KV-event message has 3 frames (topic, seq, payload), got {len(frames)}")
    topic_frame, seq_frame, payload = frames
    topic = decode_topic(topic_frame)
    ts, events, dp_rank, unknown_events, unknown_keys = decode_payload(payload)
    return EventBatch(topic, decode_seq(seq_frame), ts, tuple(events), dp_rank, unknown_events, frozenset(unknown_keys))
