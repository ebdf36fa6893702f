"""KV-cache groups of hybrid models (sliding-window, Mamba), and a worker's hit on one.

An engine serving a hybrid model keeps one KV cache per *group* of layers of one kind (vLLM's
``group_idx``, ``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``). A prefix is a hit only
where every group can serve it, each by its own rule (vLLM's HybridKVCacheCoordinator):

* full attention needs every block of the prefix: the index's chains, as for any model;
* a sliding window only the blocks inside the window before the hit's end: scanning back from
  the longest candidate, the first run of ``cdiv(window - 1, block_size)`` held blocks ends the
  hit (or, found none, the held run from the prompt's start); vLLM caches only those tail blocks;
* Mamba only the state at the hit's end: the deepest held block.

The hit is the longest length every group accepts, found by shrinking the candidate until no
group shortens it. A *window group*'s holdings (any group that is not full attention) are not a
prefix, so the index keeps each of its blocks apart: as a one-block chain named
:func:`group_block_hash` of the prompt's chain hash at the block's end (a name no prompt's chain
ever has), held by the worker itself. A match of the prompt's chain never meets them; a router
reads them per block (:meth:`kvindex.redis_index.RedisIndex.group_holders`).

Positions are counted in the index's blocks (the full-attention group's block size); a group
whose blocks are k times larger holds a block at every k-th boundary. Pure: no I/O.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import xxhash

FULL_KINDS: Final = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
WINDOW_KINDS: Final = frozenset({"sliding_window", "sliding_window_mla"})
STATE_KINDS: Final = frozenset({"mamba"})
_GROUP_TAG: Final = b"kvroute:group:v1"
_BLOCK_AND_GROUP: Final = struct.Struct("<QI")


def group_block_hash(chain_hash: int, group: int) -> int:
    """The index's name of group ``group``'s block that ends where ``chain_hash`` ends."""
    return xxhash.xxh3_64_intdigest(_BLOCK_AND_GROUP.pack(chain_hash, group) + _GROUP_TAG)


@dataclass(frozen=True)
class GroupSpec:
    """One KV-cache group as the engine describes it."""

    index: int
    kind: str
    block_size: int
    window: int | None = None  # tokens (sliding-window groups)

    @property
    def full(self) -> bool:
        """Full attention (or an engine that names no kind): the index's chains say its hit."""
        return self.kind in FULL_KINDS

    @property
    def supported(self) -> bool:
        return self.full or self.kind in STATE_KINDS or (self.kind in WINDOW_KINDS and bool(self.window))

    def run_needed(self) -> int:
        """Held blocks in a row that end a hit (a window's blocks; a state's one)."""
        if self.kind in WINDOW_KINDS and self.window:
            return max(1, -(-(self.window - 1) // self.block_size))
        return 1

    def text(self) -> str:
        return f"{self.index}:{self.kind}:{self.block_size}:{self.window or ''}"


def format_groups(groups: Iterable[GroupSpec]) -> str:
    """Groups as a worker's record keeps them: ``index:kind:block_size:window``, comma-separated."""
    return ",".join(g.text() for g in sorted(groups, key=lambda g: g.index))


def parse_groups(text: str) -> tuple[GroupSpec, ...]:
    """:func:`format_groups`'s text -> groups (a ValueError saying what is wrong)."""
    groups = []
    for item in (part for part in text.split(",") if part):
        fields = item.split(":")
        if len(fields) != 4 or not fields[0].isdigit() or not fields[2].isdigit() or not fields[1]:
            raise ValueError(f"a KV-cache group is index:kind:block_size:window, got {item!r}")
        window = int(fields[3]) if fields[3].isdigit() else None
        groups.append(GroupSpec(int(fields[0]), fields[1], int(fields[2]), window))
    return tuple(groups)


def is_hybrid(groups: Sequence[GroupSpec]) -> bool:
    """Whether a hit needs more than the index's chains (a group that is not full attention)."""
    return any(not g.full for g in groups)


def window_groups(groups: Sequence[GroupSpec], block_size: int) -> list[GroupSpec]:
    """The groups whose blocks the index keeps apart, those it can place (whole index blocks)."""
    return [g for g in groups if not g.full and g.supported and g.block_size % block_size == 0]


def group_hit(group: GroupSpec, held: frozenset[int] | set[int], limit_tokens: int) -> int:
    """Tokens of group ``group``'s hit within ``limit_tokens``; ``held``: the group-block indices
    (0-based, in the group's block size) it holds along the prompt."""
    size = group.block_size
    need = group.run_needed()
    run = 0
    for i in range(limit_tokens // size - 1, -1, -1):
        if i not in held:
            run = 0
            continue
        run += 1
        if run >= need:
            return (i + run) * size
    # none found: a sliding window's held run from the prompt's start still counts
    return run * size if group.kind in WINDOW_KINDS else 0


def hybrid_hit(groups: Sequence[GroupSpec], held: Mapping[int, frozenset[int] | set[int]], limit_tokens: int) -> int:
    """Tokens of a worker's hit: the longest length within ``limit_tokens`` (its full-attention
    prefix, capped below the prompt's last token) that every window group accepts. ``held``: per
    group index, the group-block indices it holds."""
    hit = limit_tokens
    while True:
        shortest = hit
        for group in groups:
            if not group.full:
                shortest = group_hit(group, held.get(group.index, frozenset()), shortest)
        if shortest >= hit:
            return hit
        hit = shortest
