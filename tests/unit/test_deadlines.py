"""kvservice.deadlines: many deadlines on one loop timer, on both event loops the router runs on."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

import pytest
import uvloop

from kvservice.deadlines import COMPACT_AT, DUE_SLACK_S, Deadlines

LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def run(loop_name: str, main: Callable[[], object]) -> object:
    with asyncio.Runner(loop_factory=LOOPS[loop_name]) as runner:
        return runner.run(main())  # type: ignore[arg-type]


@pytest.mark.parametrize("loop_name", sorted(LOOPS))
def test_live_deadlines_run_in_time_order_and_never_early_cancelled_ones_never(loop_name: str) -> None:
    async def main() -> tuple[list[tuple[int, float, float]], set[int]]:
        loop = asyncio.get_running_loop()
        book = Deadlines()
        rng = random.Random(7)
        ran: list[tuple[int, float, float]] = []
        all_ran = asyncio.Event()
        start = loop.time()
        entries = []
        cancelled = {i for i in range(300) if rng.random() < 0.5}

        def note(i: int, when: float) -> None:
            ran.append((i, when, loop.time()))
            if len(ran) == 300 - len(cancelled):
                all_ran.set()

        for i in range(300):
            when = start + rng.uniform(0.001, 0.08)
            entries.append((i, book.at(when, lambda i=i, when=when: note(i, when))))
        for i, entry in entries:
            if i in cancelled:
                entry.cancel()
        await asyncio.wait_for(all_ran.wait(), 10)
        last = asyncio.Event()
        book.at(start + 0.09, last.set)  # past every deadline: a cancelled one would have run before it
        await asyncio.wait_for(last.wait(), 10)
        return ran, cancelled

    ran, cancelled = run(loop_name, main)  # type: ignore[misc]
    assert {i for i, _, _ in ran} == set(range(300)) - cancelled
    assert [when for _, when, _ in ran] == sorted(when for _, when, _ in ran)
    assert all(at >= when - DUE_SLACK_S for _, when, at in ran)


@pytest.mark.parametrize("loop_name", sorted(LOOPS))
def test_an_earlier_deadline_set_later_runs_first_and_callbacks_may_set_more(loop_name: str) -> None:
    async def main() -> list[str]:
        book = Deadlines()
        order: list[str] = []
        done = asyncio.get_running_loop().create_future()
        book.later(0.2, lambda: (order.append("late"), done.set_result(None)))
        book.later(0.01, lambda: (order.append("early"), book.later(0.01, lambda: order.append("chained"))))
        await asyncio.wait_for(done, 5)
        return order

    assert run(loop_name, main) == ["early", "chained", "late"]


def test_cancelled_deadlines_do_not_pile_up() -> None:
    async def main() -> tuple[int, int]:
        book = Deadlines()
        keep = book.later(3600, lambda: None)
        most = 0
        for _ in range(20 * COMPACT_AT):
            book.later(3600, lambda: None).cancel()  # as a request's read timeout, an hour long
            most = max(most, book.entries)
        keep.cancel()
        return most, book.entries

    most, left = run("uvloop", main)  # type: ignore[misc]
    assert most <= 2 * COMPACT_AT + 1
    assert left <= 2 * COMPACT_AT


def test_a_cancelled_deadline_stays_cancelled_and_a_run_one_cannot_be_cancelled_twice() -> None:
    async def main() -> tuple[int, int]:
        book = Deadlines()
        hits = []
        ran = asyncio.Event()
        fired = book.later(0.001, lambda: (hits.append(1), ran.set()))
        gone = book.later(0.001, lambda: hits.append(2))
        gone.cancel()
        gone.cancel()
        await asyncio.wait_for(ran.wait(), 5)
        fired.cancel()  # after it ran: nothing to take back
        return sum(hits), len(book)

    assert run("uvloop", main) == (1, 0)
