"""The next layout of the index (docs/index-schema.md, "The next layout"): chains cut into pages of
``PAGE_BLOCKS`` blocks at fixed positions, and holdings stated per page.

A *holding* says "this gid holds the page's blocks from its first block through this *leaf*". A
gid's holdings in a page are the leaves of its held blocks there: held blocks with no held child
in the same page. The branch from the page's first block to a leaf is stored once, whoever holds
it, so a writer states what it holds per page, and a match reads one field per page, not one key
per block (page_apply.lua, page_match.lua).

This module is pure, with no I/O. It has:
- :func:`pages_of`, which cuts a prompt into its pages;
- :func:`page_holdings`, which gives a gid's holdings from the chains it holds;
- :func:`holding_changes`, which gives what a write must send;
- :func:`combine`, which turns page_match.lua's replies into each gid's exact depth.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

PAGE_BLOCKS = 32

Branch = tuple[int, ...]  # a page's blocks from its first through a leaf


@dataclass(frozen=True, slots=True)
class Page:
    """One page of a prompt: the hash of its first block, where it starts in the prompt, and
    how many of the prompt's blocks it covers (PAGE_BLOCKS, or fewer for the last page)."""

    first: int
    start: int
    length: int


def pages_of(chain: Sequence[int]) -> list[Page]:
    """The pages of a prompt's chain of block hashes, in order."""
    return [
        Page(chain[start], start, min(PAGE_BLOCKS, len(chain) - start)) for start in range(0, len(chain), PAGE_BLOCKS)
    ]


def page_holdings(chains: Iterable[Sequence[int]]) -> dict[int, dict[int, Branch]]:
    """A gid's holdings, from the chains whose every block it holds (each from the chain's
    first block): {page's first block: {leaf: branch}}. A branch that is the start of another
    branch in the same page is not a holding: the longer one says it already."""
    branches: dict[int, set[Branch]] = {}
    for chain in chains:
        for page in pages_of(chain):
            branches.setdefault(page.first, set()).add(tuple(chain[page.start : page.start + page.length]))
    holdings: dict[int, dict[int, Branch]] = {}
    for first, found in branches.items():
        prefixes = {b[:n] for b in found for n in range(1, len(b))}
        holdings[first] = {b[-1]: b for b in found if b not in prefixes}
    return holdings


@dataclass(frozen=True)
class PageChange:
    """What one write changes in one page for one gid: leaves gained with their branches, and
    leaves lost."""

    first: int
    gained: tuple[tuple[int, Branch], ...]
    lost: tuple[int, ...]


def holding_changes(
    before: Mapping[int, Mapping[int, Branch]], after: Mapping[int, Mapping[int, Branch]]
) -> list[PageChange]:
    """The page changes that turn holdings ``before`` into ``after`` (page_holdings' shape), in
    the order of the pages' first blocks."""
    changes = []
    for first in sorted(set(before) | set(after)):
        old, new = before.get(first, {}), after.get(first, {})
        gained = tuple((leaf, branch) for leaf, branch in sorted(new.items()) if old.get(leaf) != branch)
        lost = tuple(sorted(leaf for leaf in old if leaf not in new))
        if gained or lost:
            changes.append(PageChange(first, gained, lost))
    return changes


def branch_hex(branch: Sequence[int]) -> str:
    return "".join(f"{h:016x}" for h in branch)


def page_change_args(change: PageChange) -> list[str | int]:
    """One page's arguments for page_apply.lua: counts, then (leaf, branch) pairs, then leaves."""
    args: list[str | int] = [len(change.gained), len(change.lost)]
    for leaf, branch in change.gained:
        args += [f"{leaf:016x}", branch_hex(branch)]
    args += [f"{leaf:016x}" for leaf in change.lost]
    return args


def match_args(pages: Sequence[Page], chain: Sequence[int], chained: bool) -> list[str]:
    """page_match.lua's ARGV for ``pages`` of ``chain``: their blocks, lengths, and whether they
    are the chain's first pages, consecutive."""
    blocks = "".join(branch_hex(chain[p.start : p.start + p.length]) for p in pages)
    return [blocks, ",".join(str(p.length) for p in pages), "1" if chained else "0"]


def _gids(listed: bytes | str) -> list[int]:
    text = listed.decode() if isinstance(listed, bytes) else listed
    return [int(g) for g in text.split(",") if g]


def combine(pages: Sequence[Page], replies: Sequence[Sequence]) -> dict[int, int]:
    """Each gid's depth over ``pages`` (a chain's pages in order) from page_match.lua's
    ``{whole, {depth, gids, ...}}`` per page. A gid counts a page's blocks only while it has held
    every earlier page whole, and the page where it stops adds its depth there. Gids that match
    no block are left out. A chained call may answer fewer pages than asked (the walk ended)."""
    depths: dict[int, int] = {}
    going: set[int] | None = None  # gids that held every page so far whole (None: all, at page 0)
    for page, (whole, stops) in zip(pages, replies, strict=False):
        for i in range(0, len(stops), 2):
            for gid in _gids(stops[i + 1]):
                if going is None or gid in going:
                    depths[gid] = page.start + int(stops[i])
        held = set(_gids(whole))
        going = held if going is None else going & held
        for gid in going:
            depths[gid] = page.start + page.length
        if not going:
            break
    return depths
