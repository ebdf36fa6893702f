"""router.routing.lookups: a lookup past its budget never cuts a connection short (left to finish, or
cancelled on a channel that reads its reply anyway), and holds its slot until the reply is in."""

from __future__ import annotations

import asyncio

import pytest

from kvindex.pipelined import WireWatch, wire_watch
from router.routing.lookups import BudgetExpired, Lookups
from tests.support import wait_until


async def test_an_answer_within_the_budget_is_returned_and_errors_are_raised_as_they_are():
    lookups = Lookups(slots=2, budget_s=5, backstop_s=10)

    async def answer() -> int:
        return 7

    async def fail() -> int:
        raise ConnectionError("refused")

    assert await lookups.run(answer) == 7
    with pytest.raises(ConnectionError, match="refused"):
        await lookups.run(fail)
    assert lookups.late_replies == 0 and lookups.in_flight == 0


async def test_a_lookup_past_its_budget_finishes_in_the_background_and_is_counted():
    lookups = Lookups(slots=2, budget_s=0.01, backstop_s=10)
    reply, finished = asyncio.Event(), []

    async def slow() -> int:
        await reply.wait()
        finished.append(True)
        return 1

    with pytest.raises(BudgetExpired) as expired:
        await lookups.run(slow)
    assert not expired.value.busy and lookups.in_flight == 1
    reply.set()  # the reply arrives after the decision moved on: read, not cut off

    async def settled() -> bool:
        return lookups.late_replies == 1

    await wait_until(settled, 5)
    assert finished == [True] and lookups.in_flight == 0


async def test_with_every_slot_held_a_decision_sends_nothing_and_says_busy():
    lookups = Lookups(slots=1, budget_s=0.01, backstop_s=10)
    reply, calls = asyncio.Event(), []

    async def slow() -> int:
        calls.append("slow")
        await reply.wait()
        return 1

    async def other() -> int:
        calls.append("other")
        return 2

    with pytest.raises(BudgetExpired):
        await lookups.run(slow)
    with pytest.raises(BudgetExpired) as expired:
        await lookups.run(other)
    assert expired.value.busy and calls == ["slow"]  # never sent: no command queued behind a slow Redis
    reply.set()
    await lookups.aclose()


async def test_the_backstop_ends_a_lookup_that_never_answers():
    lookups = Lookups(slots=1, budget_s=0.01, backstop_s=0.05)

    async def never() -> int:
        await asyncio.Event().wait()
        return 0

    with pytest.raises(BudgetExpired):
        await lookups.run(never)

    async def slot_free() -> bool:
        return lookups.in_flight == 0

    await wait_until(slot_free, 5)
    assert lookups.late_replies == 1


# With a cancel-safe channel (kvindex.pipelined) a lookup runs in the decision's own task and is
# cancelled at the budget; the channel's WireWatch says when the replies it abandoned are read.
# `Wire` stands in for that channel: a request it holds is answered when the test says so.


class Wire:
    def __init__(self) -> None:
        self.requests: list[tuple[asyncio.Future[int], WireWatch]] = []
        self.abandoned = 0

    async def request(self) -> int:
        watch = wire_watch.get()
        assert watch is not None  # set by Lookups for the lookup's requests
        answer = asyncio.get_running_loop().create_future()
        watch.sent()
        self.requests.append((answer, watch))
        try:
            return await answer
        except asyncio.CancelledError:
            self.abandoned += 1
            raise

    def reply(self, value: int = 1) -> None:
        """Every reply read, as the channel reads them: the watch told, awaited or not."""
        for answer, watch in self.requests:
            if not answer.done():
                answer.set_result(value)
            watch.read()
        self.requests.clear()


async def test_a_cancel_safe_lookup_runs_in_the_callers_task():
    lookups = Lookups(slots=2, budget_s=5, backstop_s=10, cancel_safe=True)
    caller = asyncio.current_task()

    async def answer() -> asyncio.Task[object] | None:
        return asyncio.current_task()

    async def fail() -> int:
        raise ConnectionError("refused")

    assert await lookups.run(answer) is caller
    with pytest.raises(ConnectionError, match="refused"):
        await lookups.run(fail)
    assert lookups.late_replies == 0 and lookups.in_flight == 0


async def test_a_cancel_safe_lookup_past_its_budget_is_cancelled_and_holds_its_slot_until_its_reply_is_read():
    lookups = Lookups(slots=1, budget_s=0.01, backstop_s=10, cancel_safe=True)
    wire, others = Wire(), []

    async def other() -> int:
        others.append(True)
        return 2

    with pytest.raises(BudgetExpired) as expired:
        await lookups.run(wire.request)
    assert not expired.value.busy and wire.abandoned == 1  # cancelled, not left running
    assert lookups.in_flight == 1 and lookups.late_replies == 0
    with pytest.raises(BudgetExpired) as expired:
        await lookups.run(other)
    assert expired.value.busy and others == []  # nothing queued behind the unanswered request
    wire.reply()  # the abandoned reply is read: the slot is free again
    assert lookups.in_flight == 0 and lookups.late_replies == 1
    assert await lookups.run(other) == 2


async def test_a_cancel_safe_lookups_slot_comes_back_at_the_backstop_without_a_reply():
    lookups = Lookups(slots=1, budget_s=0.01, backstop_s=0.05, cancel_safe=True)
    wire = Wire()
    with pytest.raises(BudgetExpired):
        await lookups.run(wire.request)

    async def slot_free() -> bool:
        return lookups.in_flight == 0

    await wait_until(slot_free, 5)
    assert lookups.late_replies == 1
    wire.reply()  # a reply after the backstop gives nothing back twice
    assert lookups.in_flight == 0 and lookups.late_replies == 1


async def test_a_cancelled_decision_leaves_its_cancel_safe_lookups_slot_to_the_reply_or_aclose():
    lookups = Lookups(slots=1, budget_s=5, backstop_s=10, cancel_safe=True)
    wire = Wire()
    decision = asyncio.create_task(lookups.run(wire.request))

    async def sent() -> bool:
        return len(wire.requests) == 1

    await wait_until(sent, 5)
    decision.cancel()
    with pytest.raises(asyncio.CancelledError):
        await decision
    assert lookups.in_flight == 1
    await lookups.aclose()
    assert lookups.in_flight == 0 and lookups.late_replies == 1
