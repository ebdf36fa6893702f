"""The vLLM KV-event wire format, decoded in this one module (the only importer of msgpack).

A message is three ZMQ frames: topic (utf-8), seq (8 bytes big-endian) and a msgpack payload
``[ts, events, data_parallel_rank]``. Events are maps tagged by "type" (vLLM >= ~0.26) or, in
older versions, positional arrays ``["BlockStored", ...]``; both are accepted at both levels.
Block hashes are uint64 by default, or 32-byte strings with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0.
Unknown event types and unknown keys are counted and skipped; anything malformed (including a
wrong type in an optional field we use: a misread ``medium`` or ``lora_name`` would credit the
blocks to the wrong tier or prefix) raises :class:`WireError`, and nothing else: the caller counts
and skips the frame. tests/unit/test_wire_fuzz.py holds that over generated and mutated frames.
See docs/sim-engine.md ("The KV-event wire") and the real captures in tests/fixtures/.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeGuard

import msgpack

EngineHash = int | bytes
REPLAY_END_SEQ = 0xFFFFFFFFFFFFFFFF
MAX_TOKEN_ID = 0xFFFFFFFF  # token ids are hashed as u32

# Field order of each event type after "type" (the positional encoding uses this order).
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality", "ownership")
_FIELDS = {"BlockStored": _STORED_FIELDS, "BlockRemoved": _REMOVED_FIELDS, "AllBlocksCleared": ()}


class WireError(ValueError):
    """A frame or payload that is not a valid KV-event message."""


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[EngineHash, ...]
    parent_block_hash: EngineHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None = None
    medium: str | None = None
    extra_keys: tuple[Any, ...] | None = None
    group_idx: int | None = None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[EngineHash, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class EventBatch:
    topic: str
    seq: int
    ts: float
    events: tuple[Event, ...]
    dp_rank: int | None = None
    unknown_events: int = 0
    unknown_keys: frozenset[str] = field(default_factory=frozenset)


def _engine_hash(value: Any, what: str) -> EngineHash:
    if isinstance(value, bool) or not isinstance(value, int | bytes):
        raise WireError(f"{what} must be an integer or bytes, got {type(value).__name__}")
    if isinstance(value, int) and not 0 <= value < 1 << 64:
        value &= (1 << 64) - 1  # signed encoders: keep the 64 bits
    return value


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional_int(fields: dict[str, Any], name: str) -> int | None:
    value = fields.get(name)
    if value is not None and not _is_int(value):
        raise WireError(f"{name} must be an integer or nil, got {type(value).__name__}")
    return value


def _optional_str(fields: dict[str, Any], name: str) -> str | None:
    value = fields.get(name)
    if value is not None and not isinstance(value, str):
        raise WireError(f"{name} must be a string or nil, got {type(value).__name__}")
    return value


def _hashes(value: Any) -> tuple[EngineHash, ...]:
    if not isinstance(value, list | tuple) or not value:
        raise WireError("block_hashes must be a non-empty array")
    return tuple(_engine_hash(v, "a block hash") for v in value)


def _as_fields(raw: Any) -> tuple[str, dict[str, Any]]:
    """An event as (type, {field: value}) from either encoding."""
    if isinstance(raw, dict):
        kind = raw.get("type")
        if not isinstance(kind, str):
            raise WireError("an event map has no string 'type'")
        return kind, {k: v for k, v in raw.items() if k != "type"}
    if isinstance(raw, list | tuple) and raw and isinstance(raw[0], str):
        kind = raw[0]
        names = _FIELDS.get(kind, ())
        if len(raw) - 1 > len(names) and kind in _FIELDS:
            raise WireError(f"positional {kind} has {len(raw) - 1} fields, at most {len(names)} are known")
        return kind, dict(zip(names, raw[1:], strict=False))
    raise WireError(f"an event must be a map or a tagged array, got {type(raw).__name__}")


def _stored(fields: dict[str, Any]) -> BlockStored:
    hashes = _hashes(fields.get("block_hashes"))
    tokens = fields.get("token_ids")
    block_size = fields.get("block_size")
    if not _is_int(block_size) or block_size <= 0:
        raise WireError(f"BlockStored block_size must be a positive integer, got {block_size!r}")
    if not isinstance(tokens, list | tuple) or not all(_is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in tokens):
        raise WireError(f"BlockStored token_ids must be an array of integers in 0..{MAX_TOKEN_ID}")
    if len(tokens) != block_size * len(hashes):
        raise WireError(f"BlockStored has {len(tokens)} token ids for {len(hashes)} blocks of {block_size}")
    parent = fields.get("parent_block_hash")
    extra = fields.get("extra_keys")
    if extra is not None and not isinstance(extra, list | tuple):
        raise WireError(f"BlockStored extra_keys must be an array or nil, got {type(extra).__name__}")
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=None if parent is None else _engine_hash(parent, "parent_block_hash"),
        token_ids=tuple(tokens),
        block_size=block_size,
        lora_name=_optional_str(fields, "lora_name"),
        medium=_optional_str(fields, "medium"),
        extra_keys=None if extra is None else tuple(extra),
        group_idx=_optional_int(fields, "group_idx"),
    )


def decode_event(raw: Any) -> tuple[Event | None, set[str]]:
    """One event, or None for an unknown type; also the keys this decoder does not know."""
    kind, fields = _as_fields(raw)
    known = _FIELDS.get(kind)
    if known is None:
        return None, set()
    unknown = {key if isinstance(key, str) else repr(key) for key in fields if key not in known}
    if kind == "BlockStored":
        return _stored(fields), unknown
    if kind == "BlockRemoved":
        hashes = _hashes(fields.get("block_hashes"))
        return BlockRemoved(hashes, _optional_str(fields, "medium"), _optional_int(fields, "group_idx")), unknown
    return AllBlocksCleared(), unknown


def decode_payload(payload: bytes) -> tuple[float, list[Event], int | None, int, set[str]]:
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        # TypeError: a map key that is itself an array or a map (unhashable in Python)
        raise WireError(f"payload is not valid msgpack: {exc}") from None
    if not isinstance(batch, list | tuple) or len(batch) < 2 or not isinstance(batch[1], list | tuple):
        raise WireError("payload must be an array [ts, events, data_parallel_rank]")
    ts = batch[0]
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise WireError(f"batch timestamp must be a number, got {type(ts).__name__}")
    dp_rank = batch[2] if len(batch) > 2 and _is_int(batch[2]) else None
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
