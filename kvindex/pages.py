"""The layout of the index (docs/index-schema.md, "Pages, segments and buckets"): chains cut into pages of
``PAGE_BLOCKS`` blocks at fixed positions, and holdings stated per page.

Pages are kept in *segment* keys that double in size along a chain: page 0, page 1, pages 2-3,
4-7, 8-15, ... (segment s holds pages 2^(s-1) .. 2^s - 1). A segment key is named by the first
block of its first page and lives in that block's bucket. So a match reads one key per segment:
6 keys for 512 blocks, 8 for 2,048. A chain's short start, where prompts share system prompts,
is cut fine, so a shared root costs its bucket only its own pages.

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

import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

PAGE_BLOCKS = 32

Branch = tuple[int, ...]  # a page's blocks from its first through a leaf


def segment_start(page_index: int) -> int:
    """The index of the first page of the segment that holds page ``page_index``."""
    return 0 if page_index == 0 else 1 << (page_index.bit_length() - 1)


class Page(NamedTuple):
    """One page of a chain: the hash of its first block, where it starts in the chain, how many
    of the chain's blocks it covers (PAGE_BLOCKS, or fewer for the last page), and the first
    block of its segment (the segment key's name). (A tuple: a router builds ~16 per prompt.)"""

    first: int
    start: int
    length: int
    segment: int


def pages_of(chain: Sequence[int]) -> list[Page]:
    """The pages of a chain of block hashes, in order."""
    n = len(chain)
    pages = []
    for index, start in enumerate(range(0, n, PAGE_BLOCKS)):
        segment = chain[segment_start(index) * PAGE_BLOCKS]
        pages.append(Page(chain[start], start, PAGE_BLOCKS if n - start > PAGE_BLOCKS else n - start, segment))
    return pages


Where = tuple[int, int]  # a page's place: (its segment's first block, its own first block)
# A gid's holdings: {where: {leaf: branch}}
Holdings = dict[Where, dict[int, Branch]]


def page_holdings(chains: Iterable[Sequence[int]]) -> Holdings:
    """A gid's holdings, from the chains whose every block it holds (each from the chain's
    first block). A branch that is the start of another branch in the same page is not a
    holding: the longer one says it already."""
    branches: dict[Where, set[Branch]] = {}
    for chain in chains:
        for page in pages_of(chain):
            branch = tuple(chain[page.start : page.start + page.length])
            branches.setdefault((page.segment, page.first), set()).add(branch)
    holdings: Holdings = {}
    for where, found in branches.items():
        prefixes = {b[:n] for b in found for n in range(1, len(b))}
        holdings[where] = {b[-1]: b for b in found if b not in prefixes}
    return holdings


@dataclass(frozen=True)
class PageChange:
    """What one write changes in one page for one gid: leaves gained with their branches, and
    leaves lost. ``segment`` is the first block of the page's segment (its key); ``held`` how
    many leaves the gid holds there before the change (page_apply.lua checks it)."""

    segment: int
    first: int
    gained: tuple[tuple[int, Branch], ...]
    lost: tuple[int, ...]
    held: int = 0


def page_change(where: Where, old: Mapping[int, Branch], new: Mapping[int, Branch]) -> PageChange | None:
    """The change that turns a page's holdings ``old`` into ``new`` (leaf -> branch), or None."""
    gained = tuple((leaf, branch) for leaf, branch in sorted(new.items()) if old.get(leaf) != branch)
    lost = tuple(sorted(leaf for leaf in old if leaf not in new))
    return PageChange(where[0], where[1], gained, lost, len(old)) if gained or lost else None


def holding_changes(
    before: Mapping[Where, Mapping[int, Branch]], after: Mapping[Where, Mapping[int, Branch]]
) -> list[PageChange]:
    """The page changes that turn holdings ``before`` into ``after`` (page_holdings' shape), in
    the order of the pages' (segment, first block)."""
    changes = (page_change(where, before.get(where, {}), after.get(where, {})) for where in sorted({*before, *after}))
    return [change for change in changes if change is not None]


def branch_hex(branch: Sequence[int]) -> str:
    return "".join(f"{h:016x}" for h in branch)


def page_change_args(change: PageChange, key_place: int) -> list[str | int]:
    """One page's arguments for page_apply.lua: its segment key's place among the bucket's, its
    first block, the leaves held before, counts, then (leaf, branch) pairs, then leaves."""
    args: list[str | int] = [key_place, f"{change.first:016x}", change.held, len(change.gained), len(change.lost)]
    for leaf, branch in change.gained:
        args += [f"{leaf:016x}", branch_hex(branch)]
    args += [f"{leaf:016x}" for leaf in change.lost]
    return args


def segments(pages: Sequence[Page]) -> list[tuple[int, int]]:
    """(segment's first block, how many of ``pages`` are in it) for consecutive runs of ``pages``
    in one segment, in order: page_match.lua's keys."""
    runs: list[tuple[int, int]] = []
    for page in pages:
        if runs and runs[-1][0] == page.segment:
            runs[-1] = (page.segment, runs[-1][1] + 1)
        else:
            runs.append((page.segment, 1))
    return runs


def match_args(pages: Sequence[Page], chain: Sequence[int], chained: bool) -> list[bytes]:
    """page_match.lua's ARGV for ``pages`` of ``chain`` (consecutive): whether they are the
    chain's first pages, their blocks, then per segment key its page count and per page the
    fields of its last block's whole holders and its holders. (Bytes, built in one pass: a
    router builds these for every decision.)"""
    start, end = pages[0].start, pages[-1].start + pages[-1].length
    blocks = struct.pack(f">{end - start}Q", *chain[start:end]).hex().encode()
    args: list[bytes | int] = [b"1" if chained else b"0", blocks]
    count_at, segment = 0, None
    for page in pages:
        if page.segment != segment:
            segment, count_at = page.segment, len(args)
            args.append(0)
        args[count_at] += 1  # type: ignore[operator]
        last, first = 16 * (page.start + page.length - start - 1), 16 * (page.start - start)
        args += [b"e:" + blocks[last : last + 16], b"h:" + blocks[first : first + 16]]
    return [b"%d" % arg if isinstance(arg, int) else arg for arg in args]


def _listed(listed: bytes | str) -> set[bytes]:
    raw = listed.encode() if isinstance(listed, str) else listed
    found = set(raw.split(b","))
    found.discard(b"")
    return found


def _stops(start: int, stops: Sequence) -> tuple[dict[bytes, int], bytes | None, int]:
    """A page's ``{depth, gids, ...}``: the depths in the chain of the gids listed, and the list
    under a negative depth (every other gid of it stops at that depth: page_match.lua) with its
    depth in the chain."""
    stopped: dict[bytes, int] = {}
    others, others_depth = None, 0
    for i in range(0, len(stops), 2):
        depth, listed = int(stops[i]), stops[i + 1]
        if depth < 0:
            others, others_depth = listed.encode() if isinstance(listed, str) else listed, start - depth
            continue
        for gid in _listed(listed):
            stopped[gid] = start + depth
    return stopped, others, others_depth


def combine(pages: Sequence[Page], replies: Sequence[Sequence]) -> dict[int, int]:
    """:func:`combine_listed` with the gids as ints."""
    return {int(gid): depth for gid, depth in combine_listed(pages, replies).items()}


def combine_listed(pages: Sequence[Page], replies: Sequence[Sequence]) -> dict[bytes, int]:
    """Each gid's depth over ``pages`` (a chain's pages in order) from page_match.lua's
    ``{whole, {depth, gids, ...}}`` per page. A gid counts a page's blocks only while it has held
    every earlier page whole, and the page where it stops adds its depth there (a gid listed
    under a negative depth and at no other stops at that depth, unless it holds the page whole). Gids that match
    no block are left out. A chained call may answer fewer pages than asked (the walk ended).
    The gids are as the script lists them (decimal digits, bytes): a router names them from
    that form, with no int per gid per match."""
    depths: dict[bytes, int] = {}
    going: set[bytes] | None = None  # held every page so far whole (None: all, at page 0)
    previous: object = None
    end = 0
    for page, (whole, stops) in zip(pages, replies, strict=False):
        if whole != previous or stops:  # pages along one chain mostly list the same holders
            held = _listed(whole)
            stopped, others, others_depth = _stops(page.start, stops)
            if going is None:  # page 0: every gid listed stops here
                leaving = set(stopped) if others is None else set(stopped) | (_listed(others) - held)
            else:
                leaving = going - held
            for gid in leaving:
                depth = stopped.get(gid)
                if depth is None:
                    listed = others is not None and b"," + gid + b"," in others
                    depth = others_depth if listed else page.start
                depths[gid] = depth
            going = held if going is None else going & held
            previous = whole
        end = page.start + page.length
        if not going:
            break
    for gid in going or ():
        depths[gid] = end
    return {gid: depth for gid, depth in depths.items() if depth}
