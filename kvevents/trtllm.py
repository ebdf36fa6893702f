"""TensorRT-LLM's KV-cache events, decoded into kvevents.events' typed events (and encoded by the
simulated engine when it speaks TensorRT-LLM).

TensorRT-LLM has no push socket of its own: trtllm-serve hands out its event queue on
``POST /kv_cache_events`` (with ``kv_cache_config.event_buffer_max_size`` > 0), draining it, as a
JSON list written by ``tensorrt_llm._utils.KVCacheEventSerializer``::

    {"event_id": 7, "window_size": 4096, "attention_dp_rank": 0,   # the rank only with attention DP
     "data": {"type": "stored", "parent_hash": 123 | null,
              "blocks": [{"type": "stored_block", "block_hash": 456, "cache_level": 0, "priority": 35,
                          "tokens": [{"type": "unique_token", "token_id": 1, "token_extra_id": 0}, ...]}]}}

with ``data`` also ``{"type": "created", "num_blocks_per_cache_level": [...]}`` (event 0 of a
cache manager: its cache is empty), ``{"type": "removed", "block_hashes": [...]}`` and ``{"type":
"updated", "block_hash": h, "cache_level": {"type": "event_diff", "old_value": 0, "new_value": 1},
"priority": {...}}`` (a block offloaded to host memory, or brought back).

The agent polls that endpoint (worker_agent/poller.py) and hands each event on as one message
``[b"trtllm", event_id (8 bytes), the event's JSON]``: event ids count from 0 per engine process, so
the agent's sequencer sees a lost event as a gap (there is no replay: the worker is rebuilt) and a
new process as a restart. What maps where:

* ``cache_level`` 0 is the GPU, 1 host memory (the CPU tier); ``updated`` moves blocks between
  them (:class:`~kvevents.events.BlockMoved`).
* A block holds ``tokens_per_block`` tokens, or fewer when partially reused; blocks are pages to
  the agent, re-blocked into the index's blocks as SGLang's are (worker_agent/pages.py).
* ``window_size`` becomes the group index: the agent indexes the first window it sees and counts
  the others (a model with several attention windows).
* A token with a non-zero ``token_extra_id`` (prompt tuning, multimodal), ``mm_keys``, or a
  ``lora_id`` (never named in these events) cannot be hashed as the router hashes prompts: such
  blocks are counted in :attr:`EventBatch.unreproducible` and left out.

Anything malformed raises :class:`WireError` and nothing else.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Final

from kvevents.events import (
    ANY_TIER,
    EXTRA_TOKEN_IDS,
    MAX_TOKEN_ID,
    MULTIMODAL,
    UNNAMED_LORA,
    AllBlocksCleared,
    AnyEvent,
    BlockMoved,
    BlockRemoved,
    BlockStored,
    EngineHash,
    EventBatch,
    WireError,
    decode_seq,
    decode_topic,
)

TOPIC: Final = "trtllm"  # the topic the agent's poller gives each event
LEVELS: Final = ("GPU", "CPU")  # cache_level 0, 1
_U64: Final = (1 << 64) - 1
_KNOWN_KEYS: Final = {"event_id", "data", "window_size", "attention_dp_rank"}


def _int(value: Any, what: str, low: int = 0, high: int = _U64) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise WireError(f"{what} must be an integer in {low}..{high}, got {value!r}"[:160])
    return value


def _hash(value: Any, what: str) -> EngineHash:
    return _int(value, what, -(1 << 63)) & _U64


def _medium(level: Any) -> str:
    level = _int(level, "cache_level", 0, 1 << 16)
    return LEVELS[level] if level < len(LEVELS) else f"LEVEL{level}"


def _tokens(block: dict[str, Any]) -> tuple[list[int], bool]:
    """A stored block's token ids, and whether any carries an extra id."""
    tokens = block.get("tokens")
    if not isinstance(tokens, list) or not tokens:
        raise WireError("a stored block needs a non-empty 'tokens' array")
    ids, extra = [], False
    for token in tokens:
        if not isinstance(token, dict):
            raise WireError(f"a token must be an object, got {type(token).__name__}")
        ids.append(_int(token.get("token_id"), "token_id", 0, MAX_TOKEN_ID))
        extra |= _int(token.get("token_extra_id", 0), "token_extra_id") != 0
    return ids, extra


def _unreproducible(block: dict[str, Any], extra: bool) -> str | None:
    if extra:
        return EXTRA_TOKEN_IDS
    if block.get("mm_keys"):
        return MULTIMODAL
    if block.get("lora_id") is not None:
        return UNNAMED_LORA
    return None


def _stored(data: dict[str, Any], group: int | None, unreproducible: dict[str, int]) -> list[BlockStored]:
    """Runs of blocks of one size and level, each chained on the one before."""
    parent = data.get("parent_hash")
    parent = None if parent is None else _hash(parent, "parent_hash")
    blocks = data.get("blocks")
    if not isinstance(blocks, list) or not blocks:
        raise WireError("a stored event needs a non-empty 'blocks' array")
    runs: list[BlockStored] = []
    hashes: list[EngineHash] = []
    tokens: list[int] = []
    run_parent, run_key = parent, None
    for number, block in enumerate(blocks):
        if not isinstance(block, dict):
            raise WireError(f"a stored block must be an object, got {type(block).__name__}")
        block_hash = _hash(block.get("block_hash"), "block_hash")
        ids, extra = _tokens(block)
        reason = _unreproducible(block, extra)
        if reason is not None:  # the rest of the chain hangs on this block: none of it is indexed
            unreproducible[reason] = unreproducible.get(reason, 0) + len(blocks) - number
            break
        key = (len(ids), _medium(block.get("cache_level", 0)))
        if hashes and key != run_key:
            runs.append(_run(hashes, run_parent, tokens, run_key, group))
            run_parent, hashes, tokens = hashes[-1], [], []
        run_key = key
        hashes.append(block_hash)
        tokens += ids
    if hashes:
        runs.append(_run(hashes, run_parent, tokens, run_key, group))
    return runs


def _run(
    hashes: list[EngineHash], parent: EngineHash | None, tokens: list[int], key: Any, group: int | None
) -> BlockStored:
    size, medium = key
    return BlockStored(tuple(hashes), parent, tuple(tokens), size, medium=medium, group_idx=group)


def decode_event(event: Any) -> tuple[list[AnyEvent], dict[str, int], set[str]]:
    """One serialized event -> (typed events, unreproducible blocks by reason, unknown keys);
    an unknown data type gives no events and is reported as the key ``data.type=<type>``."""
    if not isinstance(event, dict):
        raise WireError(f"an event must be a JSON object, got {type(event).__name__}")
    data = event.get("data")
    if not isinstance(data, dict) or not isinstance(data.get("type"), str):
        raise WireError("an event needs a 'data' object with a string 'type'")
    window = event.get("window_size")
    group = None if window is None else _int(window, "window_size", 0, 1 << 40)
    unknown = {key for key in event if key not in _KNOWN_KEYS}
    unreproducible: dict[str, int] = {}
    kind = data["type"]
    if kind == "created":
        return [AllBlocksCleared()], unreproducible, unknown
    if kind == "stored":
        return list(_stored(data, group, unreproducible)), unreproducible, unknown
    if kind == "removed":
        hashes = data.get("block_hashes")
        if not isinstance(hashes, list) or not hashes:
            raise WireError("a removed event needs a non-empty 'block_hashes' array")
        removed = tuple(_hash(h, "block_hashes") for h in hashes)
        # removed from wherever the engine held it (its level is not said)
        return [BlockRemoved(removed, medium=ANY_TIER, group_idx=group)], unreproducible, unknown
    if kind == "updated":
        level = data.get("cache_level")
        if not isinstance(level, dict):  # a priority change alone: nothing for the index
            return [], unreproducible, unknown
        moved = (_hash(data.get("block_hash"), "block_hash"),)
        source, target = _medium(level.get("old_value")), _medium(level.get("new_value"))
        return [BlockMoved(moved, source, target, group)] if source != target else [], unreproducible, unknown
    return [], unreproducible, unknown | {f"data.type={kind}"[:80]}


def decode_message(frames: list[bytes], topic: str = TOPIC) -> EventBatch:
    """``[topic, event_id (8 bytes), one event's JSON]`` (worker_agent/poller.py) -> EventBatch."""
    if len(frames) != 3:
        raise WireError(f"a TensorRT-LLM event message has 3 frames (topic, event id, JSON), got {len(frames)}")
    topic = decode_topic(frames[0])
    try:
        event = json.loads(frames[2])
    except (ValueError, RecursionError) as exc:
        raise WireError(f"the event is not JSON: {exc}"[:160]) from None
    events, unreproducible, unknown = decode_event(event)
    rank = event.get("attention_dp_rank")
    dp_rank = rank if isinstance(rank, int) and not isinstance(rank, bool) else None
    unknown_events = sum(1 for key in unknown if key.startswith("data.type="))
    keys = frozenset(key for key in unknown if not key.startswith("data.type="))
    return EventBatch(topic, decode_seq(frames[1]), 0.0, tuple(events), dp_rank, unknown_events, keys, unreproducible)


# --- encoding (the simulated engine) --------------------------------------------------------------


def stored_json(
    event_id: int, parent: int | None, blocks: Sequence[tuple[int, Sequence[int]]], level: int = 0, window: int = 4096
) -> dict[str, Any]:
    """A stored event as KVCacheEventSerializer writes it."""
    return {
        "event_id": event_id,
        "data": {
            "type": "stored",
            "parent_hash": parent,
            "blocks": [
                {
                    "type": "stored_block",
                    "block_hash": block_hash,
                    "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in tokens],
                    "cache_level": level,
                    "priority": 35,
                }
                for block_hash, tokens in blocks
            ],
        },
        "window_size": window,
    }


def removed_json(event_id: int, hashes: Sequence[int], window: int = 4096) -> dict[str, Any]:
    return {"event_id": event_id, "data": {"type": "removed", "block_hashes": list(hashes)}, "window_size": window}


def created_json(event_id: int, blocks_per_level: Sequence[int], window: int = 4096) -> dict[str, Any]:
    data = {"type": "created", "num_blocks_per_cache_level": list(blocks_per_level)}
    return {"event_id": event_id, "data": data, "window_size": window}


def updated_json(event_id: int, block_hash: int, old_level: int, new_level: int, window: int = 4096) -> dict[str, Any]:
    diff = {"type": "event_diff", "old_value": old_level, "new_value": new_level}
    data = {"type": "updated", "block_hash": block_hash, "cache_level": diff, "priority": None}
    return {"event_id": event_id, "data": data, "window_size": window}
