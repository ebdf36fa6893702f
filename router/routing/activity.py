"""When each worker was last seen busy, for the choice among near-equal workers (pure but for the clock).

A decision sees every worker's requests in flight (booked by every replica) and its engine's
running and waiting requests; a worker seen with none for a while has served nothing since, and
the blocks it caches were used that long ago at the latest. Among workers that cost the same, a
prompt that must evict something had better evict what was used longest ago
(:func:`router.routing.choice.choose`). Kept per replica from its own decisions: with a request a
second or more, every replica sees the fleet often enough.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from router.routing.scoring import Candidate

MAX_WORKERS = 65_536  # bounded: workers gone long ago go first


class WorkerActivity:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._busy_at: dict[str, float] = {}

    def note(self, candidates: Sequence[Candidate], record: bool = True) -> list[Candidate]:
        """Record which of ``candidates`` are busy now (not with ``record`` False: a dry run changes
        nothing), and return them with their idle times."""
        now = self._clock()
        out = []
        for c in candidates:
            engine = c.engine
            busy = c.inflight.requests > 0 or (engine is not None and (engine.running > 0 or engine.waiting > 0))
            if busy and record:
                self._busy_at[c.worker_id] = now
            elif busy:
                out.append(replace(c, idle_s=0.0))
                continue
            seen = self._busy_at.get(c.worker_id)
            out.append(replace(c, idle_s=None if seen is None else now - seen))
        if len(self._busy_at) > MAX_WORKERS:
            oldest = sorted(self._busy_at, key=self._busy_at.__getitem__)[: len(self._busy_at) - MAX_WORKERS]
            for worker_id in oldest:
                del self._busy_at[worker_id]
        return out
