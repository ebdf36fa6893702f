"""A decision's Redis lookups within its budget, never cutting a connection's replies short.

Cancelling a redis-py command that is waiting for its reply closes its connection (the reply
would otherwise be read by the next command), so a Redis slower than the budget would make every
decision close a connection and the next one open another: a reconnect storm, which slows that
Redis further. Two ways out:

* ``cancel_safe`` (a single server: the lookups' batches go over :mod:`kvindex.pipelined`, which
  reads every reply whoever waits for it): the lookup runs in the decision's own task and is
  cancelled at the budget; its replies are read and dropped by the connection.
* otherwise (a cluster) a lookup runs in its own task; the decision waits for it only as long
  as its budget and then routes without it, while the command finishes in the background and
  its late reply is discarded.

Either way a lookup holds one of a fixed number of *slots* until its replies are read (or the
backstop passes): a decision that finds every slot taken by slow lookups waits for one within
its budget, or routes without Redis, never queueing more commands behind a slow server (and, on
the task path, the pool always keeps connections for the fleet refresh and the load writer).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

from kvindex.pipelined import WireWatch, wire_watch
from kvservice.deadlines import Deadlines

T = TypeVar("T")


class BudgetExpired(TimeoutError):
    """Redis did not answer within the decision's budget; ``busy``: the lookup never started,
    every slot was held by earlier lookups still waiting for a slow Redis."""

    def __init__(self, budget_s: float, busy: bool) -> None:
        why = "every lookup slot is held by slower lookups" if busy else "no reply"
        super().__init__(f"{why} within {budget_s * 1000:.0f} ms")
        self.busy = busy


class Lookups:
    def __init__(self, slots: int, budget_s: float, backstop_s: float, cancel_safe: bool = False) -> None:
        if slots < 1:
            raise ValueError(f"lookup slots must be at least 1, got {slots}")
        self._slots = asyncio.Semaphore(slots)
        self.slots = slots
        self._budget_s = budget_s
        # A lookup left to finish alone is still bounded: past this its command is cancelled
        # (which costs its connection, once per backstop, not once per decision), or, when
        # cancelling is safe, its slot is given back even though its reply has not come.
        self._backstop_s = backstop_s
        # Whether cancelling a waiting lookup is free (Scripts.cancel_safe of the lookups' client).
        self.cancel_safe = cancel_safe
        self._background: set[asyncio.Task[object]] = set()
        self.deadlines = Deadlines()  # the budgets' (kvservice.deadlines: no loop timer each)
        self._held: set[_HeldSlot] = set()  # slots of abandoned lookups whose replies are still due
        self.in_flight = 0  # lookups holding a slot now
        self.late_replies = 0  # lookups that finished after their decision had moved on
        self.stall_graces = 0  # deadlines moved on because the router itself was busy past them

    async def run(self, lookup: Callable[[], Awaitable[T]]) -> T:
        """``lookup()``'s result if it comes within the budget, else :class:`BudgetExpired`;
        errors of the lookup itself are raised as they are."""
        if self.cancel_safe:
            return await self._run_here(lookup)
        return await self._run_in_task(lookup)

    async def _run_here(self, lookup: Callable[[], Awaitable[T]]) -> T:
        """The lookup in the caller's task (no task per lookup), cancelled at the budget. The
        :class:`WireWatch` says when the replies of what it sent are read: the slot is held
        until then."""
        watch = WireWatch()
        token = wire_watch.set(watch)
        budget = asyncio.Timeout(None)  # expired by the guard
        acquired = gave_up = False
        try:
            async with budget:
                guard = _StallGuard(budget, self, self._budget_s)
                try:
                    await self._slots.acquire()
                    acquired = True
                    self.in_flight += 1
                    return await lookup()
                finally:
                    guard.cancel()
        except TimeoutError:
            if not budget.expired():
                raise  # the lookup's own
            gave_up = True
            raise BudgetExpired(self._budget_s, busy=not acquired) from None
        except asyncio.CancelledError:
            gave_up = True  # the decision was cancelled (its client went, or the router is stopping)
            raise
        finally:
            wire_watch.reset(token)
            if acquired:
                self._hold_until_read(watch, late=gave_up)

    def _hold_until_read(self, watch: WireWatch, late: bool) -> None:
        if watch.pending == 0:
            self._give_back(late)
            return
        held = _HeldSlot(self, late)
        self._held.add(held)
        watch.on_settled = held.release
        held.backstop = asyncio.get_running_loop().call_later(self._backstop_s, held.release)

    def _give_back(self, late: bool) -> None:
        self.in_flight -= 1
        self._slots.release()
        if late:
            self.late_replies += 1

    async def _run_in_task(self, lookup: Callable[[], Awaitable[T]]) -> T:
        on_wire = asyncio.Event()
        task = asyncio.create_task(self._in_slot(lookup, on_wire))
        budget = asyncio.Timeout(None)
        try:
            async with budget:
                guard = _StallGuard(budget, self, self._budget_s)
                try:
                    return await asyncio.shield(task)  # at the budget the decision stops waiting, not the lookup
                finally:
                    guard.cancel()
        except TimeoutError:
            if not budget.expired():
                raise  # the lookup's own
        except asyncio.CancelledError:
            # The decision was cancelled (its client went, or the router is stopping): the
            # lookup finishes alone like a late one, and aclose() still cancels it.
            self._leave_in_background(task)
            raise
        if task.done():  # it finished as the budget ran out
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
        """Cancel the lookups still finishing in the background (before the client closes) and
        give back the slots of abandoned ones."""
        for held in list(self._held):
            held.release()
        tasks = list(self._background)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


class _StallGuard:
    """A decision's budget: expires it at its deadline, unless the router's own stall made it late.

    When the event loop has been busy past a decision's deadline (a burst of long prompts to
    tokenize and hash, a slow callback), it runs the budget's due timer before the decision's
    task, whose reply came in time and waits in the socket or has just woken it: the decision
    routes without Redis, and a busy router degrades exactly when the index matters most. A check
    ``CHECK_AHEAD_S`` before the deadline sees such a stall (it runs at or past the deadline) and
    moves the deadline ``GRACE_S`` on, so that the loop reads its sockets and runs the woken task
    first; at most ``MAX_GRACES`` times, so that a Redis that is slow while the router is
    saturated still meets a bound. The check and the expiry are :mod:`kvservice.deadlines` entries:
    nearly every budget is cancelled unexpired, a millisecond after it is set."""

    CHECK_AHEAD_S = 0.002  # more than the event loop's timer resolution (uvloop: 1 ms)
    GRACE_S = 0.005
    MAX_GRACES = 3

    def __init__(self, budget: asyncio.Timeout, lookups: Lookups, budget_s: float) -> None:
        self._budget = budget
        self._lookups = lookups
        self._deadlines = lookups.deadlines
        self._graces = 0
        self._deadline = self._deadlines.time() + budget_s
        self._entry = self._deadlines.at(self._deadline - self.CHECK_AHEAD_S, self._check)

    def _check(self) -> None:
        now = self._deadlines.time()
        on_time = now < self._deadline  # the loop was free before the deadline
        if on_time or self._graces >= self.MAX_GRACES or self._budget.expired():
            self._entry = self._deadlines.at(self._deadline, self._expire)
            return
        self._graces += 1
        self._lookups.stall_graces += 1
        self._deadline = now + self.GRACE_S
        self._entry = self._deadlines.at(self._deadline - self.CHECK_AHEAD_S, self._check)

    def _expire(self) -> None:
        if not self._budget.expired():
            self._budget.reschedule(self._deadlines.time())  # cancels the decision's task: TimeoutError

    def cancel(self) -> None:
        self._entry.cancel()


class _HeldSlot:
    """The slot of a lookup its decision gave up on, given back once its replies are read or
    the backstop passes, whichever comes first."""

    def __init__(self, lookups: Lookups, late: bool) -> None:
        self._lookups = lookups
        self._late = late
        self.backstop: asyncio.TimerHandle | None = None

    def release(self) -> None:
        if self not in self._lookups._held:
            return  # already given back
        self._lookups._held.discard(self)
        if self.backstop is not None:
            self.backstop.cancel()
        self._lookups._give_back(self._late)
