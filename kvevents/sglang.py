"""SGLang's KV-event wire format, decoded into kvevents.events' typed events (and encoded by the
simulated engine when it speaks SGLang).

SGLang's publisher is vLLM's (ZMQ ``(topic, seq, msgpack)``, a ROUTER replay socket, seq -1 ending
a replay); what differs, from sglang 0.5.23's ``srt/disaggregation/kv_events.py`` and
``srt/mem_cache/events.py`` and from earlier releases (tests/fixtures/sglang/README.md):

* Events are tagged maps (0.5.x, as vLLM's), or positional arrays ``[tag, block_hashes,
  parent_block_hash, token_ids, block_size, lora_id]`` in earlier releases. Both are read.
* A block is one *page* (``--page-size``, 1 by default): one hash per page, consecutive pages of a
  chain coalesced into one event. A radix node's last page may be shorter; its event's
  ``block_size`` is that page's length. The agent re-blocks pages into the index's blocks
  (worker_agent/pages.py).
* ``medium`` is ``GPU``, ``CPU_PINNED``, ``DISK`` or ``EXTERNAL`` (kvindex/tiers.py knows them).
* ``cache_salt`` comes with every stored page (SGLang seeds the hashes with it). It becomes the
  first block's extra key, as vLLM sends a salt, so the agent hashes it as the router does.
* ``lora_name`` names an adapter where SGLang knows it. A ``lora_id`` without a name (earlier
  releases) cannot be hashed as the router hashes the adapter's requests.
* With EAGLE speculative decoding the radix tree is keyed by bigrams: ``token_ids`` holds
  ``[a, b]`` pairs, which no prompt hashes to.
* The batch is ``[ts, events, attn_dp_rank]`` (no rank before 0.5); each attention-DP rank
  publishes on port + rank.
* Replay replies carry ``[topic, seq, payload]`` (0.5.23) or ``[seq, payload]`` (earlier).

Blocks of the last two kinds are left out of the batch and counted in
:attr:`EventBatch.unreproducible` by reason: the worker is routed by its load for them, never by
a wrong prefix. Anything malformed raises :class:`WireError` and nothing else.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from typing import Annotated, Any, Final

import msgspec
from msgspec import Meta

from kvevents.events import (
    EAGLE_BIGRAMS,
    MAX_TOKEN_ID,
    UNNAMED_LORA,
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
    salt_of,
    salted_keys,
)

# Field order of the positional encoding (earlier releases sent the first five).
_STORED_ORDER: Final = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "cache_salt",
    "session_id",
    "lora_name",
)
_REMOVED_ORDER: Final = ("block_hashes", "medium")
_ORDERS: Final = {"BlockStored": _STORED_ORDER, "BlockRemoved": _REMOVED_ORDER, "AllBlocksCleared": ()}
# SGLang's fields that the typed events keep under their own names; the others are mapped below.
_KEPT: Final = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}
_READ_ONLY: Final = {"cache_salt", "session_id"}  # read here, not passed on as such


# --- the wire schema: the simulated engine encodes with it, the agent's strict pass decodes -------


class _Wire(msgspec.Struct, tag_field="type", tag=True, omit_defaults=True, forbid_unknown_fields=True):
    pass


class _Stored(_Wire, tag="BlockStored"):
    block_hashes: Annotated[list[EngineHash], Meta(min_length=1)]
    parent_block_hash: EngineHash | None
    token_ids: list[Annotated[int, Meta(ge=0, le=MAX_TOKEN_ID)]]  # EAGLE's pairs fail: the lenient pass
    block_size: Annotated[int, Meta(gt=0)]
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class _Removed(_Wire, tag="BlockRemoved"):
    block_hashes: Annotated[list[EngineHash], Meta(min_length=1)]
    medium: str | None = None


class _Cleared(_Wire, tag="AllBlocksCleared"):
    pass


class _Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[_Stored | _Removed | _Cleared]
    attn_dp_rank: int | None = None


_ENCODER = msgspec.msgpack.Encoder()
_STRICT = msgspec.msgpack.Decoder(_Batch)


# vLLM's media as SGLang names them (StorageMedium)
_MEDIA: Final = {"CPU": "CPU_PINNED", "REMOTE": "EXTERNAL"}


def _salt_in(event: BlockStored) -> str | None:
    """The salt a vLLM-shaped run carries in its first block's extra keys."""
    return salt_of(event.extra_keys[0] if event.extra_keys else None, event.lora_name)[1]


def _wire_event(event: Event) -> _Stored | _Removed | _Cleared:
    if isinstance(event, BlockStored):
        return _Stored(
            list(event.block_hashes),
            event.parent_block_hash,
            list(event.token_ids),
            event.block_size,
            None,
            medium=_MEDIA.get(event.medium or "", event.medium),
            cache_salt=_salt_in(event),
            lora_name=event.lora_name,
        )
    if isinstance(event, BlockRemoved):
        return _Removed(list(event.block_hashes), _MEDIA.get(event.medium or "", event.medium))
    return _Cleared()


def encode_payload(events: Sequence[Event], dp_rank: int = 0, ts: float | None = None) -> bytes:
    """A batch as SGLang 0.5.23 sends it. A salted run's salt goes with it as ``cache_salt`` (SGLang
    sends it with every page of the run; a run here starts at its first block or continues one)."""
    wire = [_wire_event(event) for event in events]
    return _ENCODER.encode(_Batch(time.time() if ts is None else ts, wire, dp_rank))


# --- decoding (the agent) -------------------------------------------------------------------------


def _is_bigrams(tokens: Any) -> bool:
    return isinstance(tokens, list) and bool(tokens) and all(isinstance(t, list) and len(t) == 2 for t in tokens)


def _unreproducible(fields: dict[Any, Any]) -> str | None:
    """Why a stored run's blocks cannot be hashed as the router hashes prompts (None: they can)."""
    if _is_bigrams(fields.get("token_ids")):
        return EAGLE_BIGRAMS
    if fields.get("lora_id") is not None and fields.get("lora_name") is None:
        return UNNAMED_LORA
    return None


def _typed_fields(kind: str, fields: dict[Any, Any]) -> tuple[dict[Any, Any], set[str]]:
    """SGLang's fields as the typed event's, and the keys neither knows."""
    kept = _KEPT[kind]
    typed = {key: value for key, value in fields.items() if key in kept}
    skipped = (key for key in fields if key not in kept and key not in _READ_ONLY)
    unknown = {key if isinstance(key, str) else repr(key) for key in skipped}
    salt = fields.get("cache_salt")
    if salt is not None:
        if not isinstance(salt, str):
            raise WireError(f"{kind}: cache_salt must be a string, got {type(salt).__name__}")
        hashes = fields.get("block_hashes")
        if fields.get("parent_block_hash") is None and isinstance(hashes, list) and hashes:
            # the salt seeds the run's first block; its later blocks follow from the chain
            typed["extra_keys"] = salted_keys(salt, len(hashes))
    session = fields.get("session_id")
    if session is not None and not isinstance(session, str):
        raise WireError(f"{kind}: session_id must be a string, got {type(session).__name__}")
    return typed, unknown


def decode_event(raw: Any) -> tuple[Event | None, set[str], str | None]:
    """One event from its generic msgpack form: (the event or None, the unknown keys, why its blocks
    cannot be reproduced or None). An unknown type is (None, set(), None)."""
    kind, fields = event_fields(raw, _ORDERS)
    if kind not in _KEPT:
        return None, set(), None
    if kind == "BlockStored" and (reason := _unreproducible(fields)) is not None:
        hashes = fields.get("block_hashes")
        if not isinstance(hashes, list) or not hashes:
            raise WireError("BlockStored: block_hashes must be a non-empty array")
        return None, set(), reason
    typed, unknown = _typed_fields(kind, fields)
    event, extra = convert_event(kind, typed)
    return event, unknown | extra, None


def _typed(event: _Stored | _Removed | _Cleared) -> Event | None:
    """A strictly decoded event as the typed one (None: its blocks cannot be hashed)."""
    if isinstance(event, _Removed):
        return BlockRemoved(tuple(event.block_hashes), medium=event.medium)
    if isinstance(event, _Cleared):
        return AllBlocksCleared()
    if event.lora_id is not None and event.lora_name is None:
        return None
    # the salt seeds the run's first block; its later blocks follow from the chain
    keys = salted_keys(event.cache_salt, len(event.block_hashes)) if event.parent_block_hash is None else None
    try:
        return BlockStored(
            tuple(event.block_hashes),
            event.parent_block_hash,
            tuple(event.token_ids),
            event.block_size,
            event.lora_id,
            event.medium,
            event.lora_name,
            keys,
        )
    except ValueError as exc:  # its own checks (token count against blocks)
        raise WireError(f"BlockStored: {exc}") from None


def _decode_strictly(payload: bytes) -> tuple[float, list[Event], int | None, int, set[str], dict[str, int]] | None:
    """The one-pass decode every SGLang 0.5.x message of plain text prompts takes; None for any other."""
    try:
        batch = _STRICT.decode(payload)
    except msgspec.DecodeError:  # also ValidationError: anything unusual goes the lenient way
        return None
    events = []
    for wire in batch.events:
        event = _typed(wire)
        if event is None:
            return None  # a block it cannot hash: the lenient pass counts it by reason
        events.append(event)
    return batch.ts, events, batch.attn_dp_rank, 0, set(), {}


def decode_payload(payload: bytes) -> tuple[float, list[Event], int | None, int, set[str], dict[str, int]]:
    """(ts, events, attn_dp_rank, unknown event count, unknown keys, unreproducible blocks by reason)."""
    return _decode_strictly(payload) or _decode_leniently(payload)


def _decode_leniently(payload: bytes) -> tuple[float, list[Event], int | None, int, set[str], dict[str, int]]:
    """Field by field: unknown kinds and keys counted, blocks that cannot be hashed counted by reason."""
    ts, raws, dp_rank = generic_batch(payload, "attn_dp_rank")
    events: list[Event] = []
    unknown_events = 0
    unknown_keys: set[str] = set()
    unreproducible: Counter[str] = Counter()
    for raw in raws:
        event, extra, reason = decode_event(raw)
        unknown_keys |= extra
        if reason is not None:
            unreproducible[reason] += len(raw["block_hashes"] if isinstance(raw, dict) else raw[1])
        elif event is None:
            unknown_events += 1
        else:
            events.append(event)
    return ts, events, dp_rank, unknown_events, unknown_keys, dict(unreproducible)


def decode_message(frames: list[bytes], topic: str = "") -> EventBatch:
    """A PUB message ``[topic, seq, payload]``, or a replayed one (without its leading empty frame)
    in either form; ``topic`` stands for the topic a ``[seq, payload]`` reply leaves out."""
    if len(frames) == 3:
        topic = decode_topic(frames[0])
    elif len(frames) != 2:
        raise WireError(f"an SGLang KV-event message has 3 frames (topic, seq, payload) or 2, got {len(frames)}")
    seq_frame, payload = frames[-2:]
    ts, events, dp_rank, unknown_events, unknown_keys, unreproducible = decode_payload(payload)
    return EventBatch(
        topic,
        decode_seq(seq_frame),
        ts,
        tuple(events),
        dp_rank,
        unknown_events,
        frozenset(unknown_keys),
        unreproducible,
    )


__all__ = [
    "EAGLE_BIGRAMS",
    "UNNAMED_LORA",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "decode_message",
    "decode_payload",
    "encode_payload",
]
