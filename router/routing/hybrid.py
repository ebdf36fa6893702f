"""A hybrid model's hit per worker: the index's chains (its full-attention group) cut by what its
sliding-window and Mamba groups hold (kvindex/groups.py, as vLLM's hybrid cache manager finds a
hit). Only for such models, one or two more reads of the index: who holds each window group's
blocks along the prompt (:func:`hybrid_matches`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvindex.groups import GroupSpec, group_block_hash, hybrid_hit, window_groups


class GroupHolders(Protocol):
    """What a hybrid hit reads: the routing port (kvindex.routing_index), or an index itself."""

    async def group_holders(self, model: str, names: Sequence[int]) -> list[set[str]]: ...


def hit_limits(
    groups: Sequence[GroupSpec], matches: dict[str, int], prompt_tokens: int, block_size: int
) -> dict[str, int]:
    """Per worker, the tokens its hit can reach before the window groups have their say: its
    full-attention prefix (every worker's whole prompt where no group is full attention), never
    the prompt's last token (an engine computes it)."""
    cap = max(prompt_tokens - 1, 0) // block_size * block_size
    if groups and not any(g.full for g in groups):
        return dict.fromkeys(matches, cap)
    return {worker: min(depth * block_size, cap) for worker, depth in matches.items()}


async def hybrid_matches(
    index: GroupHolders,
    model: str,
    groups: Sequence[GroupSpec],
    chain: Sequence[int],
    prompt_tokens: int,
    block_size: int,
    matches: dict[str, int],
) -> dict[str, int]:
    """``matches`` (the full-attention prefix per worker, in the index's blocks of ``block_size``
    tokens: the prompt's ``chain``) -> each worker's hit in blocks.

    Two reads at most: first each window group's blocks just below each worker's limit (a
    window's run there accepts the limit itself, the common case: a shared prefix whose window
    the worker keeps); only for workers that one does not settle, every block up to their limit."""
    limits = hit_limits(groups, matches, prompt_tokens, block_size)
    windows = window_groups(groups, block_size)
    held: dict[str, dict[int, set[int]]] = {worker: {} for worker in limits}
    near = {(g, i) for g in windows for limit in set(limits.values()) for i in _window_below(g, limit)}
    await _read(index, model, chain, block_size, windows, near, held)
    settled = {
        worker: limit
        for worker, limit in limits.items()
        if all(set(_window_below(g, limit)) <= held[worker].get(g.index, set()) for g in windows)
    }
    rest = {worker: limit for worker, limit in limits.items() if worker not in settled}
    deepest = max(rest.values(), default=0)
    every = {(g, i) for g in windows for i in range(deepest // g.block_size)} - near
    if every:
        await _read(index, model, chain, block_size, windows, every, held)
    hits = {worker: hybrid_hit(groups, held[worker], limit) for worker, limit in rest.items()}
    return {worker: tokens // block_size for worker, tokens in (settled | hits).items()}


def _window_below(group: GroupSpec, limit_tokens: int) -> range:
    """The group-block indices of the run that would end a hit at ``limit_tokens``."""
    end = limit_tokens // group.block_size
    return range(max(end - group.run_needed(), 0), end)


async def _read(
    index: GroupHolders,
    model: str,
    chain: Sequence[int],
    block_size: int,
    windows: Sequence[GroupSpec],
    places: set[tuple[GroupSpec, int]],
    held: dict[str, dict[int, set[int]]],
) -> None:
    """Who holds each (group, group-block index) of ``places``, into ``held`` per worker."""
    ordered = sorted(places, key=lambda place: (place[0].index, place[1]))
    names = [
        group_block_hash(chain[(i + 1) * (group.block_size // block_size) - 1], group.index) for group, i in ordered
    ]
    for (group, i), holders in zip(ordered, await index.group_holders(model, names), strict=True):
        for worker in holders & held.keys():
            held[worker].setdefault(group.index, set()).add(i)
