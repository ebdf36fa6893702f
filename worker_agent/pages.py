"""Engine pages -> the index's blocks, for engines whose cache is paged finer (or coarser) than
the index's block: SGLang's radix cache publishes one hash per page, ``--page-size`` tokens and 1
by default, and a node's last page may be shorter.

Each page the engine holds is kept with what its chain has past the index's last block boundary
(fewer than ``block_size`` tokens) and the blocks it completed. A stored page whose chain crosses a
boundary completes a block: it comes out as a stored run of the index's block size, under a
synthetic engine hash (the page's hash and the block's number within it), so that
:class:`worker_agent.translate.Translator` hashes it, chains it and counts it per tier as any
engine's block. A page removed from a tier removes the blocks it completed from that tier. A page
ends a block only when the engine holds every page before it on the chain (a store names its
parent), so the index never credits a block the engine does not hold whole; the last
``block_size - 1`` tokens of a chain are not indexed, as the router matches whole blocks only.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec

from kvevents.events import (
    ANY_TIER,
    AllBlocksCleared,
    AnyEvent,
    BlockMoved,
    BlockRemoved,
    BlockStored,
    EngineHash,
    Event,
    salt_of,
    salted_keys,
)
from kvindex.tiers import tier_of
from worker_agent.translate import TranslateCounters


@dataclass(slots=True)
class _Page:
    tail: tuple[int, ...]  # the chain's tokens past the last block boundary
    last_block: bytes | None  # the synthetic hash of the chain's last whole block, if any
    salt: str | None  # the chain's salt (its first block's extra key)
    stored: BlockStored | None  # the blocks this page completed, as a run (None: none)
    tiers: set[str] = field(default_factory=set)  # the tiers holding the page (the media's tiers)
    group: int | None = None  # the engine's group (TensorRT-LLM: its attention window)


def _block_id(page: EngineHash, number: int) -> bytes:
    """The synthetic engine hash of the ``number``-th block a page completed."""
    raw = page if isinstance(page, bytes) else page.to_bytes(8, "big")
    return b"p" + raw + number.to_bytes(4, "big")


def _tier(medium: str | None) -> str:
    """The tier a page is held in, as the translator tells them apart (an unknown medium by its name)."""
    return tier_of(medium) or str(medium)


class PageBlocks:
    """Per-worker re-blocking state: the pages the engine holds."""

    def __init__(self, block_size: int, counters: TranslateCounters | None = None) -> None:
        self.block_size = block_size
        # A page is the engine's block: an orphan page, or a removal of one never stored, is
        # counted as the translator counts an engine block's.
        self.counters = counters or TranslateCounters()
        self._pages: dict[EngineHash, _Page] = {}

    def __len__(self) -> int:
        return len(self._pages)

    def reset(self) -> None:
        self._pages.clear()

    def translate(self, events: Iterable[AnyEvent]) -> list[Event]:
        out: list[Event] = []
        for event in events:
            if isinstance(event, AllBlocksCleared):
                self._pages.clear()
                out.append(event)
            elif isinstance(event, BlockStored):
                self._stored(event, out)
            elif isinstance(event, BlockMoved):
                self._moved(event, out)
            else:
                self._removed(event, out)
        return out

    def _stored(self, event: BlockStored, out: list[Event]) -> None:
        size, tier = event.block_size, _tier(event.medium)
        above: _Page | None = None  # the page each one chains on: the event's parent, then the page before it
        if event.parent_block_hash is not None:
            above = self._pages.get(event.parent_block_hash)
            if above is None:  # the whole run chains on the missing page
                self.counters.orphan_runs += 1
                self.counters.orphan_blocks += len(event.block_hashes)
                return
        salt = (
            salt_of(event.extra_keys[0] if event.extra_keys else None, event.lora_name)[1]
            if above is None
            else above.salt
        )
        for number, page_hash in enumerate(event.block_hashes):
            page = self._pages.get(page_hash)
            if page is None:
                tokens = tuple(event.token_ids[number * size : (number + 1) * size])
                page = self._pages[page_hash] = self._new_page(event, page_hash, above, tokens, salt)
            if tier not in page.tiers:
                page.tiers.add(tier)
                if page.stored is not None:
                    out.append(msgspec.structs.replace(page.stored, medium=event.medium))
            above = page

    def _new_page(
        self, event: BlockStored, page_hash: EngineHash, above: _Page | None, tokens: tuple[int, ...], salt: str | None
    ) -> _Page:
        tail, last = (tokens, None) if above is None else (above.tail + tokens, above.last_block)
        size = self.block_size
        whole = len(tail) // size
        if not whole:
            return _Page(tail, last, salt, None, group=event.group_idx)
        ids = tuple(_block_id(page_hash, n) for n in range(whole))
        stored = BlockStored(
            block_hashes=ids,
            parent_block_hash=last,
            token_ids=tail[: whole * size],
            block_size=size,
            lora_name=event.lora_name,
            group_idx=event.group_idx,
            extra_keys=salted_keys(salt, whole) if last is None else None,
        )
        return _Page(tail[whole * size :], ids[-1], salt, stored, group=event.group_idx)

    def _removed(self, event: BlockRemoved, out: list[Event]) -> None:
        """Remove the pages from the event's tier, or from every tier holding them (ANY_TIER)."""
        removed: dict[str, list[EngineHash]] = {}
        for page_hash in event.block_hashes:
            page = self._pages.get(page_hash)
            tiers = set(page.tiers) if page is not None and event.medium == ANY_TIER else {_tier(event.medium)}
            if page is None or not tiers & page.tiers:
                self.counters.unknown_removals += 1
                continue
            for tier in tiers & page.tiers:
                page.tiers.discard(tier)
                if page.stored is not None:
                    removed.setdefault(tier, []).extend(page.stored.block_hashes)
            if not page.tiers:
                del self._pages[page_hash]
        for tier, ids in removed.items():
            out.append(BlockRemoved(block_hashes=tuple(ids), medium=tier, group_idx=event.group_idx))

    def _moved(self, event: BlockMoved, out: list[Event]) -> None:
        """Pages that left one tier for another: their blocks go from one and are stored in the other."""
        source, target = _tier(event.source), _tier(event.target)
        for page_hash in event.block_hashes:
            page = self._pages.get(page_hash)
            if page is None or source not in page.tiers:
                self.counters.unknown_removals += 1
                continue
            page.tiers.discard(source)
            if page.stored is not None:
                out.append(BlockRemoved(page.stored.block_hashes, medium=source, group_idx=page.group))
            if target not in page.tiers:
                page.tiers.add(target)
                if page.stored is not None:
                    out.append(msgspec.structs.replace(page.stored, medium=target))
