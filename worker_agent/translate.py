"""Engine KV events -> index changes, in the index's own hashing.

The engine's block hashes are never used as routing keys: they depend on its hash algorithm,
seed and PYTHONHASHSEED, and arrive truncated to 64 bits. The router must compute the same key
from a prompt alone, so the agent re-hashes each stored block's ``token_ids`` with
:mod:`kvindex.hashing`, carrying the request's ``cache_salt`` (the first block's extra key) and
``lora_name`` into the chain's first hash exactly as the router does. It keeps a map from the
engine's hash to ours, with a reference count per copy, so that BlockRemoved (which names only the
engine's hash) can be applied.

Choices (see docs/agent.md):
* Every tier the engine reports (``medium``: GPU, CPU, disk, remote; kvindex/tiers.py) is indexed,
  each apart: a batch's changes come out per tier, written to the worker (GPU) and to its tier
  holders. One engine hash stands for one content in every tier (vLLM's offloading keeps the
  block's hash), so the map to our hashes is shared and the copies are counted per tier. Tiers
  left out of ``tiers`` (the agent's --tiers), and media not known, are counted and skipped.
* Hybrid models publish one stream per KV-cache group (kvindex/groups.py). The first
  full-attention group (or the only group, where the engine names no kind) is indexed as the
  worker's chains; sliding-window and Mamba groups block by block as one-block chains
  (worker_agent/windows.py), on the GPU tier only; other full-attention groups are counted and
  skipped (vLLM stores and frees them with the first). A batch's full-attention events are taken
  first: a window group's blocks are placed by the chain its full-attention group just stored.
* A stored run whose parent the agent does not know is counted and skipped, never guessed.
* Blocks with extra keys the router cannot reproduce (multimodal inputs) start an unknown chain:
  they are skipped like orphans, so a text prompt can never match an image's blocks.

Pure: no I/O, so it is tested directly against the reference index.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored, EngineHash, Event, salt_of
from kvindex.groups import GroupSpec
from kvindex.hashing import extend_sequence_hashes
from kvindex.tiers import GPU, TIERS, tier_of
from kvindex.types import BlockChange, RemovedBlocks, StoredRun
from worker_agent.windows import WindowBlocks, full_first, group_spec


@dataclass
class TranslateCounters:
    """What translation did, for the agent's metrics."""

    blocks_stored: int = 0
    blocks_removed: int = 0
    clears: int = 0
    orphan_runs: int = 0  # stored runs whose parent is unknown
    orphan_blocks: int = 0
    unknown_removals: int = 0  # removed engine hashes the agent never saw stored
    other_tier_events: int = 0
    other_group_events: int = 0
    block_size_mismatches: int = 0
    unsupported_extra_keys: int = 0
    hash_conflicts: int = 0  # an engine hash stored again with different content
    window_blocks_stored: int = 0  # blocks of sliding-window and Mamba groups
    window_blocks_removed: int = 0


@dataclass
class TranslatedBatch:
    """One engine batch as index work: ``clear`` first (when the batch held AllBlocksCleared:
    every tier), then each tier's changes in order: ``changes`` the GPU's, ``lower`` the other
    tiers' by tier. Changes before the last clear are dropped: it wipes them."""

    clear: bool = False
    changes: list[BlockChange] = field(default_factory=list)
    lower: dict[str, list[BlockChange]] = field(default_factory=dict)

    def of(self, tier: str) -> list[BlockChange]:
        """The changes of ``tier`` (a new list to append to when it has none yet)."""
        return self.changes if tier == GPU else self.lower.setdefault(tier, [])


def _plain_keys(event: BlockStored) -> bool:
    """Whether a window group's blocks carry only what the router reproduces (vLLM aligns
    ``extra_keys`` with the stored blocks, not the span's)."""
    if not event.extra_keys:
        return True
    representable, _ = salt_of(event.extra_keys[0], event.lora_name)
    return representable and _later_keys_ok(event.extra_keys, event.lora_name)


def _later_keys_ok(extra_keys: Sequence[Any], lora_name: str | None) -> bool:
    """Blocks after the first may only carry the LoRA name (vLLM repeats it per block)."""
    return all(
        keys is None or (isinstance(keys, list | tuple) and list(keys) in ([], [lora_name])) for keys in extra_keys[1:]
    )


class Translator:
    """Per-worker translation state: the engine-hash map and the learned block size."""

    def __init__(self, block_size: int | None = None, tiers: frozenset[str] = frozenset(TIERS)) -> None:
        self.block_size = block_size
        self.tiers = tiers
        self.counters = TranslateCounters()
        self._ours: dict[EngineHash, int] = {}
        # copies per tier: an engine hash's mapping goes when no tier holds a copy any more
        self._tier_refs: dict[tuple[str, EngineHash], int] = {}
        self.groups: dict[int, GroupSpec] = {}  # the KV-cache groups seen, by index
        self._main_group: int | None = None  # the full-attention group indexed as chains
        self._windows = WindowBlocks()

    def __len__(self) -> int:
        return len(self._ours)

    def our_hash(self, engine_hash: EngineHash) -> int | None:
        return self._ours.get(engine_hash)

    def reset(self) -> None:
        """The engine's cache is empty (restart, clear, or a resync)."""
        self._ours.clear()
        self._tier_refs.clear()
        self._windows.clear()

    def translate(self, events: Iterable[Event]) -> TranslatedBatch:
        out = TranslatedBatch()
        for event in full_first(events, self.groups):
            if isinstance(event, AllBlocksCleared):
                self.counters.clears += 1
                self.reset()
                out = TranslatedBatch(clear=True)
            elif (tier := self._indexed_tier(event)) is None:
                continue
            elif (spec := self._window_group(event)) is not None:
                if tier == GPU:
                    out.changes.extend(self._window_change(event, spec))
                else:
                    self.counters.other_tier_events += 1
            elif isinstance(event, BlockStored):
                run = self._stored(event, tier)
                if run is not None:
                    out.of(tier).append(run)
            else:
                removed = self._removed(event, tier)
                if removed:
                    out.of(tier).append(RemovedBlocks(tuple(removed)))
        return out

    def _indexed_tier(self, event: BlockStored | BlockRemoved) -> str | None:
        tier = tier_of(event.medium)
        if tier is None or tier not in self.tiers:
            self.counters.other_tier_events += 1
            return None
        if isinstance(event, BlockStored) and event.group_idx is not None and event.group_idx not in self.groups:
            spec = group_spec(event)
            if spec is not None:
                self.groups[spec.index] = spec
        group = event.group_idx or 0
        known = self.groups.get(group)
        if known is None or known.full:
            if self._main_group is None:
                self._main_group = group
            if group != self._main_group:
                self.counters.other_group_events += 1
                return None
        elif not known.supported:
            self.counters.other_group_events += 1
            return None
        return tier

    def _window_group(self, event: BlockStored | BlockRemoved) -> GroupSpec | None:
        """The event's group when it is kept block by block (not the chains' group)."""
        spec = self.groups.get(event.group_idx or 0)
        return None if spec is None or spec.full else spec

    def _window_change(self, event: BlockStored | BlockRemoved, spec: GroupSpec) -> list[BlockChange]:
        if isinstance(event, BlockRemoved):
            removed = self._windows.removed(event, spec, self.counters)
            return [RemovedBlocks(tuple(removed))] if removed else []
        if self.block_size is None and self._main_group is None:
            self.block_size = event.block_size  # no full-attention group: the window's blocks are the index's
        parent = None
        if event.parent_block_hash is not None:
            parent = self._ours.get(event.parent_block_hash) or self._windows.our_hash(event.parent_block_hash)
            if parent is None:
                self.counters.orphan_runs += 1
                self.counters.orphan_blocks += len(event.block_hashes)
                return []
        if not _plain_keys(event):
            self.counters.unsupported_extra_keys += 1
            return []
        if self.block_size is None or event.block_size % self.block_size:
            self.counters.block_size_mismatches += 1
            return []
        _, salt = salt_of(event.extra_keys[0] if event.extra_keys and parent is None else None, event.lora_name)
        chain = extend_sequence_hashes(
            parent, event.token_ids, self.block_size, lora_name=event.lora_name, cache_salt=salt
        )
        stored = self._windows.stored(event, spec, chain, self._ours, self.counters)
        return [StoredRun(None, (block,)) for block in stored]

    def _stored(self, event: BlockStored, tier: str) -> StoredRun | None:
        if len(event.token_ids) != event.block_size * len(event.block_hashes):
            # a window group's span (its kind says so) with no group index to keep it apart by:
            # not a chain of the full-attention group
            self.counters.other_group_events += 1
            return None
        if self.block_size is None:
            self.block_size = event.block_size
        elif event.block_size != self.block_size:
            self.counters.block_size_mismatches += 1  # enforced: such blocks could never match
            return None
        parent: int | None = None
        salt: str | None = None
        if event.parent_block_hash is not None:
            parent = self._ours.get(event.parent_block_hash)
            representable = parent is not None
            if not representable:
                self.counters.orphan_runs += 1
                self.counters.orphan_blocks += len(event.block_hashes)
                return None
        else:
            representable, salt = salt_of(event.extra_keys[0] if event.extra_keys else None, event.lora_name)
        if not representable or (event.extra_keys and not _later_keys_ok(event.extra_keys, event.lora_name)):
            self.counters.unsupported_extra_keys += 1
            return None
        ours = extend_sequence_hashes(
            parent, event.token_ids, event.block_size, lora_name=event.lora_name, cache_salt=salt
        )
        for position, (engine_hash, our_hash) in enumerate(zip(event.block_hashes, ours, strict=True)):
            known = self._ours.setdefault(engine_hash, our_hash)
            if known != our_hash:
                # Two contents under one 64-bit engine hash: keep the first mapping (removals
                # carry only the engine hash) and stop the run here rather than mis-chain it.
                self.counters.hash_conflicts += 1
                ours = ours[:position]
                break
            self._tier_refs[tier, engine_hash] = self._tier_refs.get((tier, engine_hash), 0) + 1
        self.counters.blocks_stored += len(ours)
        return StoredRun(parent, tuple(ours)) if ours else None

    def _removed(self, event: BlockRemoved, tier: str) -> list[int]:
        removed = []
        for engine_hash in event.block_hashes:
            our_hash = self._ours.get(engine_hash)
            copies = self._tier_refs.get((tier, engine_hash), 0)
            if our_hash is None or copies == 0:
                self.counters.unknown_removals += 1
                continue
            if copies > 1:
                self._tier_refs[tier, engine_hash] = copies - 1
            else:
                del self._tier_refs[tier, engine_hash]
                if not any((other, engine_hash) in self._tier_refs for other in TIERS):
                    del self._ours[engine_hash]
            removed.append(our_hash)
        self.counters.blocks_removed += len(removed)
        return removed
