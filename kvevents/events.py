"""The typed KV events every engine's decoder produces (kvevents.vllm, kvevents.sglang), and what
the agent reads from them. vLLM's events are the reference form: their fields, in vLLM's order, are
these structs' (vLLM's positional encoding depends on it); another engine's decoder maps its own
fields onto them (its media onto tier names kvindex/tiers.py knows, its salt into ``extra_keys``).

Malformed input raises :class:`WireError` and nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping
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
# A BlockRemoved's medium for an engine that does not say the tier (TensorRT-LLM): wherever it is.
ANY_TIER: Final = "*"


class BlockMoved(msgspec.Struct, frozen=True):
    """Blocks moved from one tier to another (TensorRT-LLM's ``updated`` of ``cache_level``): no
    wire of vLLM's or SGLang's carries it. Only for paged engines (worker_agent/pages.py), which
    keep the blocks' tokens to store them again in the other tier."""

    block_hashes: tuple[EngineHash, ...]
    source: str
    target: str
    group_idx: int | None = None


AnyEvent = Event | BlockMoved
KINDS: Final[dict[str, type[BlockStored] | type[BlockRemoved] | type[AllBlocksCleared]]] = {
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}
FIELDS: Final = {kind: tuple(f.name for f in msgspec.structs.fields(cls)) for kind, cls in KINDS.items()}

# Why an engine's stored blocks cannot be hashed as the router hashes prompts (EventBatch's
# ``unreproducible`` keys), with what the agent says once about each.
EAGLE_BIGRAMS: Final = "eagle_bigrams"
UNNAMED_LORA: Final = "unnamed_lora"
EXTRA_TOKEN_IDS: Final = "extra_token_ids"
MULTIMODAL: Final = "multimodal"
UNREPRODUCIBLE: Final = {
    EAGLE_BIGRAMS: "with EAGLE speculative decoding SGLang keys its cache by token pairs",
    UNNAMED_LORA: "a LoRA adapter named only by the engine's internal id",
    EXTRA_TOKEN_IDS: "tokens with extra ids (prompt tuning, multimodal input) hold more than their token ids",
    MULTIMODAL: "blocks of multimodal input hold more than their token ids",
}

# Types msgpack carries itself: converting a lenient pass's values must not coerce to them (a
# string is not a 32-byte hash, whatever base64 would make of it).
_MSGPACK_NATIVE: Final = (bytes, bytearray, datetime)


@dataclass(frozen=True)
class EventBatch:
    """One decoded message. ``unreproducible`` counts, by reason, the blocks an engine stored in a
    way the router's hash cannot rebuild (left out of ``events``: the worker is routed by load for them)."""

    topic: str
    seq: int
    ts: float
    events: tuple[AnyEvent, ...]
    dp_rank: int | None = None
    unknown_events: int = 0
    unknown_keys: frozenset[str] = field(default_factory=frozenset)
    unreproducible: Mapping[str, int] = field(default_factory=dict)


def convert_event(kind: str, fields: dict[Any, Any]) -> tuple[Event | None, set[str]]:
    """The event ``kind`` from its fields (generic msgpack values), or None for a kind not known;
    also the keys the schema does not know (skipped)."""
    cls = KINDS.get(kind)
    if cls is None:
        return None, set()
    known = FIELDS[kind]
    unknown = {key if isinstance(key, str) else repr(key) for key in fields if key not in known}
    if unknown:
        fields = {key: value for key, value in fields.items() if key in known}
    try:
        return msgspec.convert({"type": kind, **fields}, cls, builtin_types=_MSGPACK_NATIVE), unknown
    except msgspec.ValidationError as exc:
        raise WireError(f"{kind}: {exc}") from None


def salt_of(first_block_keys: Any, lora_name: str | None) -> tuple[bool, str | None]:
    """(representable, cache_salt) from a run's first block's extra keys.

    vLLM puts ``[lora_name?, *multimodal keys, cache_salt?]`` there; the router reproduces the LoRA
    name and one salt string, nothing else."""
    if first_block_keys is None:
        return True, None
    if not isinstance(first_block_keys, list | tuple):
        return False, None
    keys = list(first_block_keys)
    if lora_name is not None and keys and keys[0] == lora_name:
        keys = keys[1:]
    if not keys:
        return True, None
    if len(keys) == 1 and isinstance(keys[0], str):
        return True, keys[0]
    return False, None


def salted_keys(salt: str | None, blocks: int) -> tuple[Any, ...] | None:
    """The extra keys of a run of ``blocks`` blocks whose first carries ``salt``, as vLLM sends a
    salt (None: no salt)."""
    return None if salt is None else ([salt], *[None] * (blocks - 1))


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise WireError(f"seq frame must be 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big")


def decode_topic(frame: bytes) -> str:
    try:
        return frame.decode("utf-8")
    except UnicodeDecodeError:
        raise WireError("topic frame is not utf-8") from None


def batch_timestamp(value: Any) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise WireError(f"batch timestamp must be a number, got {type(value).__name__}")
    return float(value)


def generic_batch(payload: bytes, rank_name: str) -> tuple[float, list[Any], int | None]:
    """A msgpack batch ``[ts, events, rank]`` read without a schema: (ts, the raw events, the rank)."""
    try:
        batch = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise WireError(f"payload is not valid msgpack: {exc}") from None
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise WireError(f"payload must be an array [ts, events, {rank_name}]")
    rank = batch[2] if len(batch) > 2 else None
    return batch_timestamp(batch[0]), batch[1], rank if isinstance(rank, int) and not isinstance(rank, bool) else None


def event_fields(raw: Any, orders: Mapping[str, tuple[str, ...]]) -> tuple[str, dict[Any, Any]]:
    """An event as (type, {field: value}), from a map tagged by ``type`` or from a positional array
    ``[type, ...]`` whose fields come in ``orders[type]``'s order."""
    if isinstance(raw, dict):
        kind = raw.get("type")
        if not isinstance(kind, str):
            raise WireError("an event map has no string 'type'")
        return kind, {k: v for k, v in raw.items() if k != "type"}
    if isinstance(raw, list | tuple) and raw and isinstance(raw[0], str):
        kind, names = raw[0], orders.get(raw[0], ())
        if len(raw) - 1 > len(names) and kind in orders:
            raise WireError(f"positional {kind} has {len(raw) - 1} fields, at most {len(names)} are known")
        return kind, dict(zip(names, raw[1:], strict=False))
    raise WireError(f"an event must be a map or a tagged array, got {type(raw).__name__}")
