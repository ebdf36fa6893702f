"""The blocks of a hybrid model's sliding-window and Mamba groups, as the index keeps them.

Such a group caches only some blocks of a prompt (vLLM frees those that slide out of the window
before caching, and stores the ones a later hit can use), so its holdings are not a prefix: the
index keeps each block apart, under :func:`kvindex.groups.group_block_hash` of the prompt's chain
hash where the block ends, held by the worker (kvindex/groups.py).

Where a block sits: vLLM's ``BlockStored`` for such a group names the stored blocks' hashes but
carries the tokens of the whole span it cached (from the parent on), and the blocks it skipped
are those that slid out of the window first, so the stored ones are the span's last blocks. Each
block's chain hash is the full-attention group's for the same engine hash where the agent holds
that (it carries the request's identity even when the group did not store block 0), else hashed
from the span's tokens.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored, EngineHash, Event
from kvindex.groups import FULL_KINDS, GroupSpec, group_block_hash


class _Counters(Protocol):
    window_blocks_stored: int
    window_blocks_removed: int
    unknown_removals: int


def group_spec(event: BlockStored) -> GroupSpec | None:
    """The group an event describes (vLLM annotates its stores), None when it names no kind."""
    if event.group_idx is None or not event.kv_cache_spec_kind:
        return None
    window = event.kv_cache_spec_sliding_window
    window = window if isinstance(window, int) else None
    return GroupSpec(event.group_idx, event.kv_cache_spec_kind, event.block_size, window)


def full_first(events: Iterable[Event], groups: Mapping[int, GroupSpec]) -> list[Event]:
    """A batch with, between clears, its full-attention groups' events before the others' (each
    group's own order kept): their chains place the other groups' blocks."""

    def is_window(event: Event) -> bool:
        kind = event.kv_cache_spec_kind if isinstance(event, BlockStored) else None
        if kind:
            return kind not in FULL_KINDS
        spec = groups.get(getattr(event, "group_idx", None) or 0)
        return spec is not None and not spec.full

    out: list[Event] = []
    segment: list[Event] = []
    for event in events:
        if isinstance(event, AllBlocksCleared):
            out.extend(sorted(segment, key=is_window))
            out.append(event)
            segment = []
        else:
            segment.append(event)
    out.extend(sorted(segment, key=is_window))
    return out


class WindowBlocks:
    """Per (group, engine hash): the chain hash where the block ends, and its copies."""

    def __init__(self) -> None:
        self._held: dict[tuple[int, EngineHash], tuple[int, int]] = {}
        # engine hash -> (chain hash, groups holding it): a parent's chain hash after its
        # full-attention copy went
        self._by_engine: dict[EngineHash, tuple[int, int]] = {}

    def clear(self) -> None:
        self._held.clear()
        self._by_engine.clear()

    def our_hash(self, engine_hash: EngineHash) -> int | None:
        held = self._by_engine.get(engine_hash)
        return None if held is None else held[0]

    def stored(
        self,
        event: BlockStored,
        spec: GroupSpec,
        chain: Sequence[int],
        full_hashes: Mapping[EngineHash, int],
        counters: _Counters,
    ) -> list[int]:
        """The index's names of the blocks ``event`` stores. ``chain``: the span's chain hashes
        in the index's block size (``event.block_size`` is a whole number of them)."""
        per_block = event.block_size // (len(event.token_ids) // len(chain)) if chain else 1
        span = len(event.token_ids) // event.block_size
        first = span - len(event.block_hashes)
        names = []
        for position, engine_hash in enumerate(event.block_hashes, start=first):
            ours = full_hashes.get(engine_hash) if per_block == 1 else None
            if ours is None:
                end = (position + 1) * per_block - 1
                if not 0 <= end < len(chain):
                    continue
                ours = chain[end]
            key = (spec.index, engine_hash)
            _, copies = self._held.get(key, (ours, 0))
            self._held[key] = (ours, copies + 1)
            if copies == 0:
                _, groups = self._by_engine.get(engine_hash, (ours, 0))
                self._by_engine[engine_hash] = (ours, groups + 1)
            names.append(group_block_hash(ours, spec.index))
        counters.window_blocks_stored += len(names)
        return names

    def removed(self, event: BlockRemoved, spec: GroupSpec, counters: _Counters) -> list[int]:
        names = []
        for engine_hash in event.block_hashes:
            key = (spec.index, engine_hash)
            held = self._held.get(key)
            if held is None:
                counters.unknown_removals += 1
                continue
            ours, copies = held
            if copies > 1:
                self._held[key] = (ours, copies - 1)
            else:
                del self._held[key]
                _, groups = self._by_engine[engine_hash]
                if groups > 1:
                    self._by_engine[engine_hash] = (ours, groups - 1)
                else:
                    del self._by_engine[engine_hash]
                names.append(group_block_hash(ours, spec.index))
        counters.window_blocks_removed += len(names)
        return names
