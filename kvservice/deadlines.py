"""Many short-lived deadlines on one event-loop timer.

Every routed request sets a few deadlines (the decision's Redis budget and its stall check, the
read timeout of each wait for a worker's reply, the lean front's body and keep-alive timers) and
nearly all of them are cancelled a millisecond later, unexpired. An event-loop timer each cost
~2 us to arm and cancel and an ``asyncio.timeout`` ~6 us on a warm machine, several times that
on the benchmark's cold one (~8% of a multi-turn request's busy samples in a profile:
docs/benchmarks-history.md, run 17). Here a deadline is an entry in a heap: setting one is a push,
cancelling it a flag; a single loop timer stays armed for the earliest live entry, and cancelled
entries are dropped when they reach the top or when they are over half of the heap. Callbacks
run on the loop at their time, within the loop's timer resolution, as ``loop.call_at``'s do.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable

COMPACT_AT = 256  # cancelled entries kept before the heap is rebuilt without them (when half)
# uvloop rounds a timer's delay to whole milliseconds, so its timer may run up to half of one
# before the time asked: what is that close is due (or the timer would be re-armed until then).
DUE_SLACK_S = 0.0005


class Deadline:
    """One deadline; :meth:`cancel` before it passes and its callback never runs."""

    __slots__ = ("_callback", "_owner")

    def __init__(self, callback: Callable[[], object], owner: Deadlines) -> None:
        self._callback: Callable[[], object] | None = callback
        self._owner = owner

    @property
    def live(self) -> bool:
        return self._callback is not None

    def cancel(self) -> None:
        if self._callback is not None:
            self._callback = None
            self._owner._cancelled_one()

    def _take(self) -> Callable[[], object] | None:
        callback, self._callback = self._callback, None
        return callback


class Deadlines:
    """Deadlines on one event loop: the running one when the first is set. Each owner (the
    front, the workers' connection pool, the lookups) has its own, so none outlives its loop."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        # (when, order, deadline): compared in C, never past the order, which is unique
        self._heap: list[tuple[float, int, Deadline]] = []
        self._order = itertools.count()
        self._cancelled = 0  # cancelled entries still in the heap
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0

    def __len__(self) -> int:
        """Live deadlines."""
        return len(self._heap) - self._cancelled

    @property
    def entries(self) -> int:
        """Entries held, the cancelled ones not yet dropped included."""
        return len(self._heap)

    def at(self, when: float, callback: Callable[[], object]) -> Deadline:
        """Run ``callback`` on the loop at ``when`` (the loop's clock) unless cancelled first."""
        deadline = Deadline(callback, self)
        heapq.heappush(self._heap, (when, next(self._order), deadline))
        if self._timer is None or when < self._timer_at:
            self._arm(when)
        return deadline

    def later(self, delay_s: float, callback: Callable[[], object]) -> Deadline:
        return self.at(self.time() + delay_s, callback)

    def time(self) -> float:
        """The loop's clock, which deadlines are set in."""
        return self._bound_loop().time()

    def _bound_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = self._bound_loop().call_at(when, self._fire), when

    def _cancelled_one(self) -> None:
        self._cancelled += 1
        if self._cancelled >= COMPACT_AT and self._cancelled * 2 > len(self._heap):
            self._heap = [entry for entry in self._heap if entry[2].live]
            heapq.heapify(self._heap)
            self._cancelled = 0
            if not self._heap and self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def _fire(self) -> None:
        self._timer = None
        heap, now = self._heap, self.time() + DUE_SLACK_S
        due = []
        while heap and (not heap[0][2].live or heap[0][0] <= now):
            callback = heapq.heappop(heap)[2]._take()
            if callback is None:
                self._cancelled -= 1
            else:
                due.append(callback)
        if heap:
            self._arm(heap[0][0])
        for callback in due:  # after the heap is consistent: a callback may set or cancel deadlines
            callback()
