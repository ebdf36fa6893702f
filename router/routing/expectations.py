"""Which of a prompt's blocks a decision marks "expected" on its worker, and looks up as expected
on others: its checkpoints (powers of two and the full length), so that a burst of prompts that
share a prefix sees the first one's choice before the engine's KV events reach the index
(router.shared.replica_load keeps this replica's, kvindex.shared_load the others')."""

from __future__ import annotations

import functools
from collections.abc import Sequence


@functools.lru_cache(maxsize=4096)
def checkpoints(length: int) -> tuple[int, ...]:
    """Depths checked against expected prefixes: powers of two and the full length. Remembered:
    a decision asks for them up to four times (~1% of the router's CPU when computed each time)."""
    depths = {length} | {1 << k for k in range(length.bit_length()) if 1 << k <= length}
    return tuple(sorted(d for d in depths if d > 0))


def expected_blocks(chain: Sequence[int]) -> list[int]:
    """The prompt's blocks that a worker it is sent to is marked "expected" to hold."""
    return [chain[d - 1] for d in checkpoints(len(chain))]
