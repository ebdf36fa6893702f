"""A hybrid model's hit per worker: the index's chains (its full-attention group) cut by what its
sliding-window and Mamba groups hold (kvindex/groups.py, as vLLM's hybrid cache manager finds a
hit). One more read of the index, only for such models: each window group's blocks along the
prompt, as far as the deepest worker's full-attention prefix goes."""

from __future__ import annotations

from collections.abc import Sequence

from kvindex.groups import GroupSpec, group_block_hash, hybrid_hit, window_groups
from kvindex.interface import KVIndex


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
    index: KVIndex,
    model: str,
    groups: Sequence[GroupSpec],
    chain: Sequence[int],
    prompt_tokens: int,
    block_size: int,
    matches: dict[str, int],
) -> dict[str, int]:
    """``matches`` (the full-attention prefix per worker, in the index's blocks of ``block_size``
    tokens: the prompt's ``chain``) -> each worker's hit in blocks."""
    limits = hit_limits(groups, matches, prompt_tokens, block_size)
    deepest = max(limits.values(), default=0)
    names: list[int] = []
    places: list[tuple[int, int]] = []  # (group, group-block index) of each name
    for group in window_groups(groups, block_size):
        per_block = group.block_size // block_size
        for i in range(deepest // group.block_size):
            names.append(group_block_hash(chain[(i + 1) * per_block - 1], group.index))
            places.append((group.index, i))
    held: dict[str, dict[int, set[int]]] = {worker: {} for worker in limits}
    for (group_index, i), holders in zip(places, await index.group_holders(model, names), strict=True):
        for worker in holders & held.keys():
            held[worker].setdefault(group_index, set()).add(i)
    return {worker: hybrid_hit(groups, held[worker], limit) // block_size for worker, limit in limits.items()}
