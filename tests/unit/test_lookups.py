"""router.lookups: a lookup past its budget is left to finish (never cancelled on the wire)."""

from __future__ import annotations

import asyncio

import pytest

from router.lookups import BudgetExpired, Lookups
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
