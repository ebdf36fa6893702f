"""A decision's Redis lookups within its budget, never cancelled once on the wire.

Cancelling a redis-py command that is waiting for its reply closes its connection (the reply
would otherwise be read by the next command), so a Redis slower than the budget made every
decision close a connection and the next one open another: a reconnect storm, which slows that
Redis further. Here a lookup runs in its own task; the decision waits for it only as long as its
budget and then routes without it, while the command finishes in the background and its late
reply is discarded. Lookups hold one of a fixed number of *slots* (fewer than the connection
pool's size, so that the fleet refresh and the load writer always find a connection): a decision
that finds every slot taken by slow lookups waits for one within its budget, or routes without
Redis, never queueing more commands behind a slow server.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


class BudgetExpired(TimeoutError):
    """Redis did not answer within the decision's budget; ``busy``: the lookup never started,
    every slot was held by earlier lookups still waiting for a slow Redis."""

    def __init__(self, budget_s: float, busy: bool) -> None:
        why = "every lookup slot is held by slower lookups" if busy else "no reply"
        super().__init__(f"{why} within {budget_s * 1000:.0f} ms")
        self.busy = busy


class Lookups:
    def __init__(self, slots: int, budget_s: float, backstop_s: float) -> None:
        if slots < 1:
            raise ValueError(f"lookup slots must be at least 1, got {slots}")
        self._slots = asyncio.Semaphore(slots)
        self.slots = slots
        self._budget_s = budget_s
        # A lookup left to finish alone is still bounded: past this its command is cancelled
        # (which costs its connection, once per backstop, not once per decision).
        self._backstop_s = backstop_s
        self._background: set[asyncio.Task[object]] = set()
        self.in_flight = 0  # lookups holding a slot now
        self.late_replies = 0  # lookups that finished after their decision had moved on

    async def run(self, lookup: Callable[[], Awaitable[T]]) -> T:
        """``lookup()``'s result if it comes within the budget, else :class:`BudgetExpired`;
        errors of the lookup itself are raised as they are."""
        on_wire = asyncio.Event()
        task = asyncio.create_task(self._in_slot(lookup, on_wire))
        try:
            done, _ = await asyncio.wait({task}, timeout=self._budget_s)
        except asyncio.CancelledError:
            # The decision was cancelled (its client went, or the router is stopping): the
            # lookup finishes alone like a late one, and aclose() still cancels it.
            self._leave_in_background(task)
            raise
        if task in done:
            return task.result()
        if not on_wire.is_set():  # still waiting for a slot: nothing sent, safe to cancel
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise BudgetExpired(self._budget_s, busy=True)
        self._leave_in_background(task)
        raise BudgetExpired(self._budget_s, busy=False)

    def _leave_in_background(self, task: asyncio.Task[T]) -> None:
        self._background.add(task)  # type: ignore[arg-type]
        task.add_done_callback(self._discard)  # type: ignore[arg-type]

    async def _in_slot(self, lookup: Callable[[], Awaitable[T]], on_wire: asyncio.Event) -> T:
        async with self._slots:
            on_wire.set()
            self.in_flight += 1
            try:
                async with asyncio.timeout(self._backstop_s):
                    return await lookup()
            finally:
                self.in_flight -= 1

    def _discard(self, task: asyncio.Task[object]) -> None:
        self._background.discard(task)
        self.late_replies += 1
        if not task.cancelled():
            task.exception()  # retrieved: a late failure is no one's concern any more

    async def aclose(self) -> None:
        """Cancel the lookups still finishing in the background (before the client closes)."""
        tasks = list(self._background)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
