"""What a writer sends in the page layout (kvindex.pages): where each indexed block sits, and
which holdings each write changes.

The writer's :class:`~kvindex.mirror.BlockMirror` turns engine events into index operations
(blocks that become indexed or stop being indexed, parents first or children first). A
:class:`PagePlacer` follows those operations:
- it keeps where each indexed block sits: its depth in its chain, its page's first block and its
  segment's first block;
- it keeps which indexed blocks each page has.
From that it gives a page's holdings, its leaves and their branches, on demand.

:func:`plan_pages` compares those holdings with what the generation has sent (its
``GenerationWrites.sent``) and gives the page changes, bucket by bucket.

Pure bookkeeping: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvindex.keys import bucket_of
from kvindex.mirror import IndexAdd, IndexOp
from kvindex.pages import PAGE_BLOCKS, Branch, PageChange, Where, page_change, segment_start


class PagePlacer:
    """Where one worker's indexed blocks sit in the page layout (fed by its mirror's operations)."""

    def __init__(self) -> None:
        self._place: dict[int, tuple[int, int, int, int | None]] = {}  # block -> depth, page, segment, parent
        self._pages: dict[Where, set[int]] = {}

    def __len__(self) -> int:
        return len(self._place)

    def clear(self) -> None:
        self._place.clear()
        self._pages.clear()

    def apply(self, ops: Iterable[IndexOp]) -> dict[Where, int]:
        """Follow index operations in order; returns each page they touched with its change in
        indexed blocks."""
        touched: dict[Where, int] = {}
        for op in ops:
            if isinstance(op, IndexAdd):
                where = self._add(op)
                touched[where] = touched.get(where, 0) + 1
            else:
                place = self._place.pop(op.block, None)
                if place is None:
                    continue
                where = (place[2], place[1])
                blocks = self._pages[where]
                blocks.discard(op.block)
                if not blocks:
                    del self._pages[where]
                touched[where] = touched.get(where, 0) - 1
        return touched

    def _add(self, op: IndexAdd) -> Where:
        parent = self._place.get(op.parent) if op.parent is not None else None
        depth = 0 if parent is None else parent[0] + 1
        if depth % PAGE_BLOCKS:
            page, segment = parent[1], parent[2]  # type: ignore[index]
        else:
            index = depth // PAGE_BLOCKS
            page = op.block
            segment = op.block if segment_start(index) == index else parent[2]  # type: ignore[index]
        self._place[op.block] = (depth, page, segment, op.parent)
        self._pages.setdefault((segment, page), set()).add(op.block)
        return (segment, page)

    def sizes(self) -> dict[Where, int]:
        """Every page with indexed blocks, and how many (a re-assert writes them all)."""
        return {where: len(blocks) for where, blocks in self._pages.items()}

    def leaves(self, where: Where) -> dict[int, Branch]:
        """The page's holdings: each indexed block with no indexed child in the page, with its
        branch from the page's first block."""
        blocks = self._pages.get(where)
        if not blocks:
            return {}
        place = self._place
        inner = {place[b][3] for b in blocks}
        holdings: dict[int, Branch] = {}
        for leaf in blocks - inner:
            branch = [leaf]
            block = leaf
            while place[block][0] % PAGE_BLOCKS:
                block = place[block][3]  # type: ignore[assignment]
                branch.append(block)
            holdings[leaf] = tuple(reversed(branch))
        return holdings


@dataclass
class SentPages:
    """The holdings one generation's writes have stated, page by page, and how many pages it
    holds in each bucket (a page log longer than twice that is rewritten)."""

    holdings: dict[Where, dict[int, Branch]] = field(default_factory=dict)
    per_bucket: dict[int, int] = field(default_factory=dict)

    def set(self, where: Where, bucket: int, now: dict[int, Branch]) -> None:
        had = where in self.holdings
        if now:
            self.holdings[where] = now
            if not had:
                self.per_bucket[bucket] = self.per_bucket.get(bucket, 0) + 1
        elif had:
            del self.holdings[where]
            self.per_bucket[bucket] -= 1

    def pages_in(self, bucket: int) -> list[Where]:
        return [where for where in self.holdings if bucket_of(where[0]) == bucket]


@dataclass
class BucketPlan:
    """One bucket's part of a write: its page changes and the change in indexed blocks."""

    bucket: int
    changes: list[PageChange] = field(default_factory=list)
    block_delta: int = 0


def plan_pages(placer: PagePlacer, sent: SentPages, touched: Mapping[Where, int]) -> list[BucketPlan]:
    """The page changes that bring ``sent`` (what the generation's writes said, updated here)
    to the placer's holdings in the ``touched`` pages, bucket by bucket in bucket order."""
    plans: dict[int, BucketPlan] = {}
    for where in sorted(touched):
        now = placer.leaves(where)
        bucket = bucket_of(where[0])
        plan = plans.setdefault(bucket, BucketPlan(bucket))
        plan.block_delta += touched[where]
        change = page_change(where, sent.holdings.get(where, {}), now)
        if change is not None:
            plan.changes.append(change)
        sent.set(where, bucket, now)
    return [plans[b] for b in sorted(plans) if plans[b].changes or plans[b].block_delta]


def log_entries(pages: Sequence[Where]) -> str:
    """A page log (page_apply.lua's format): 32 hex digits per page, its segment's first block
    then its own."""
    return "".join(f"{segment:016x}{first:016x}" for segment, first in pages)
