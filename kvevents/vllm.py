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
from dataclasses import dataclass, field
from datetime import datetime
from typing import Annotated, Any, Final

import msgspec
from msgspec import UNSET, Meta, UnsetType

EngineHash = int | bytes
MAX_TOKEN_ID: Final = 0xFFFFFFFF  # token ids are hashed as u32
REPLAY_END_SEQ: Final = 0xFFFFFFFFFFFFFFFF  # the seq of the replay socket's end-of-replay message
_U64: Final = (1 << 64) - 1

BlockHashes = Annotated[tuple[EngineHash, ...], Meta(min_length=1)]
# a sliding-window group's store may name no block (all of its span slid out of the window)
StoredHashes = tuple[EngineHash, ...]
TokenIds = tuple[Annotated[int, Meta(ge=0, le=MAX_TOKEN_ID)], ...]


class WireError(ValueError):
    """A frame or payload that is not a valid KV-event message."""


def _unsigned(hashes: tuple[EngineHash, ...]) -> tuple[EngineHash, ...]:
    """Hashes from a signed encoder, as the 64 bits they carry."""
    if any(isinstance(h, int) and h < 0 for h in hashes):
        return tuple(h & _U64 if isinstance(h, int) else h for h in hashes)
    return hashes


class _Event(msgspec.Struct, tag_field="type", tag=True, frozen=True, forbid_unknown_fields=True):
    """An event as vLLM tags it. Unknown keys fail the strict pass and are counted by the lenient one."""


class BlockStored(_Event, frozen=True):
    """Full blocks written to one tier. The fields are vLLM 0.32/0.33's, in vLLM's order (the
    positional encoding depends on it); those after ``kv_cache_spec_kind`` came later and are sent
    only when set, so the simulated engine's events are key for key those of vLLM 0.32."""

    block_hashes: StoredHashes
    parent_block_hash: EngineHash | None
    token_ids: TokenIds
    block_size: Annotated[int, Meta(gt=0)]
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None  # per block; vLLM's lora name, multimodal keys, salt
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | UnsetType | None = UNSET
    locality: Any = UNSET
    ownership: Any = UNSET
    session_id: Any = UNSET
    lookahead_token_ids: Any = UNSET

    def __post_init__(self) -> None:
        # A full-attention group's run has its blocks' tokens; a sliding-window or Mamba group's
        # the tokens of the whole span it cached, of which it stores some blocks (the others slid
        # out of the window: worker_agent/windows.py).
        tokens, blocks, size = len(self.token_ids), len(self.block_hashes), self.block_size
        spans = self.kv_cache_spec_kind not in (None, "full_attention") and tokens % size == 0
        if not blocks and not (spans and tokens):
            raise ValueError("BlockStored names no block")
        if tokens != size * blocks and not (spans and tokens >= size * blocks):
            raise ValueError(f"BlockStored has {len(self.token_ids)} token ids for {blocks} blocks of {size}")
        msgspec.structs.force_setattr(self, "block_hashes", _unsigned(self.block_hashes))
        parent = self.parent_block_hash
        if isinstance(parent, int) and parent < 0:
            msgspec.structs.force_setattr(self, "parent_block_hash", parent & _U64)


class BlockRemoved(_Event, frozen=True):
    """Blocks evicted from one tier, named by the engine's hashes only."""

    block_hashes: BlockHashes
    medium: str | None = None
    group_idx: int | None = None
    locality: Any = UNSET
    ownership: Any = UNSET

    def __post_init__(self) -> None:
        msgspec.structs.force_setattr(self, "block_hashes", _unsigned(self.block_hashes))


class AllBlocksCleared(_Event, frozen=True):
    """The engine emptied its cache (a reset of the prefix cache)."""


Event = BlockStored | BlockRemoved | AllBlocksCleared
_KINDS: Final[dict[str, type[BlockStored] | type[BlockRemoved] | type[AllBlocksCleared]]] = {
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}
_FIELDS: Final = {kind: tuple(f.name for f in msgspec.structs.fields(cls)) for kind, cls in _KINDS.items()}


class _Payload(msgspec.Struct, array_like=True):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


_STRICT = msgspec.msgpack.Decoder(_Payload)
# Types msgpack carries itself: converting the lenient pass's values must not coerce to them (a
# string is not a 32-byte hash, whatever base64 would make of it).
_MSGPACK_NATIVE: Final = (bytes, bytearray, datetime)
_ENCODER = msgspec.msgpack.Encoder()


@dataclass(frozen=True)
class EventBatch:
    """One decoded message."""

    topic: str
    seq: int
    ts: float
    events: tuple[Event, ...]
    dp_rank: int | None = None
    unknown_events: int = 0
    unknown_keys: frozenset[str] = field(default_factory=frozenset)


# --- encoding (the simulated engine) --------------------------------------------------------------


def encode_payload(events: Sequence[Event], dp_rank: int = 0, ts: float | None = None) -> bytes:
    return _ENCODER.encode(_Payload(time.time() if ts is None else ts, list(events), dp_rank))


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


# --- decoding (the agent) -------------------------------------------------------------------------


def _as_fields(raw: Any) -> tuple[str, dict[Any, Any]]:
    """An event as (type, {field: value}) from either encoding."""
    if isinstance(raw, dict):
        kind = raw.get("type")
        if not isinstance(kind, str):
            raise WireError("an event map has no string 'type'")
        return kind, {k: v for k, v in raw.items() if k != "type"}
    if isinstance(raw, list | tuple) and raw and isinstance(raw[0], str):
        kind, names = raw[0], _FIELDS.get(raw[0], ())
        if len(raw) - 1 > len(names) and kind in _FIELDS:
            raise WireError(f"positional {kind} has {len(raw) - 1} fields, at most {len(names)} are known")
        return kind, dict(zip(names, raw[1:], strict=False))
    raise WireError(f"an event must be a map or a tagged array, got {type(raw).__name__}")


def decode_event(raw: Any) -> tuple[Event | None, set[str]]:
    """One event from its generic msgpack form, or None for an unknown type; also the keys this
    schema does not know (skipped)."""
    kind, fields = _as_fields(raw)
    cls = _KINDS.get(kind)
    if cls is None:
        return None, set()
    known = _FIELDS[kind]
    unknown = {key if isinstance(key, str) else repr(key) for key in fields if key not in known}
    if unknown:
        fields = {key: value for key, value in fields.items() if key in known}
    try:
        return msgspec.convert({"type": kind, **fields}, cls, builtin_types=_MSGPACK_NATIVE), unknown
    except msgspec.ValidationError as exc:
        raise WireError(f"{kind}: {exc}") from None


def _decode_leniently(payload: bytes) -> tuple[float, list[Event], int | None, int, set[str]]:
    try:
        batch = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise WireError(f"payload is not valid msgpack: {exc}") from None
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise WireError("payload must be an array [ts, events, data_parallel_rank]")
    ts = batch[0]
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise WireError(f"batch timestamp must be a number, got {type(ts).__name__}")
    rank = batch[2] if len(batch) > 2 else None
    dp_rank = rank if isinstance(rank, int) and not isinstance(rank, bool) else None
    events: list[Event] = []
    unknown_events = 0
    unknown_keys: set[str] = set()
    for raw in batch[1]:
        event, extra = decode_event(raw)
        unknown_keys |= extra
        if event is None:
            unknown_events += 1
        else:
            events.append(event)
    return float(ts), events, dp_rank, unknown_events, unknown_keys


def decode_payload(payload: bytes) -> tuple[float, list[Event], int | None, int, set[str]]:
    """(ts, events, dp_rank, unknown event count, unknown keys)."""
    try:
        strict = _STRICT.decode(payload)
    except msgspec.DecodeError:  # also ValidationError: anything unusual goes the lenient way
        return _decode_leniently(payload)
    return float(strict.ts), strict.events, strict.data_parallel_rank, 0, set()


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise WireError(f"seq frame must be 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big")


def decode_message(frames: list[bytes]) -> EventBatch:
    """A PUB message (or a replayed one, without its leading empty frame) -> EventBatch."""
    if len(frames) != 3:
        raise WireError(f"a KV-event message has 3 frames (topic, seq, payload), got {len(frames)}")
    topic_frame, seq_frame, payload = frames
    try:
        topic = topic_frame.decode("utf-8")
    except UnicodeDecodeError:
        raise WireError("topic frame is not utf-8") from None
    ts, events, dp_rank, unknown_events, unknown_keys = decode_payload(payload)
    return EventBatch(topic, decode_seq(seq_frame), ts, tuple(events), dp_rank, unknown_events, frozenset(unknown_keys))
