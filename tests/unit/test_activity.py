"""When each worker was last seen busy, and the draw among near-equal workers it weighs (pure)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from kvindex.shared_load import InflightLoad
from kvindex.types import WorkerLoad
from router.routing.activity import WorkerActivity
from router.routing.choice import choose
from router.routing.decide import home_key
from router.routing.scoring import Candidate, ScoringWeights


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_idle_time_runs_from_the_last_decision_that_saw_the_worker_busy():
    clock = Clock()
    activity = WorkerActivity(clock)
    booked = Candidate("a", "http://a", inflight=InflightLoad(1, 100, 0))
    running = Candidate("b", "http://b", engine=WorkerLoad(running=1, waiting=0, kv_usage=0.1))
    idle = Candidate("c", "http://c")
    assert [c.idle_s for c in activity.note([booked, running, idle])] == [0.0, 0.0, None]
    clock.now += 3.0
    quiet_a, quiet_b = Candidate("a", "http://a"), Candidate("b", "http://b")
    assert [c.idle_s for c in activity.note([quiet_a, quiet_b, idle])] == [3.0, 3.0, None]
    # a dry run (/debug/route) sees a busy worker as busy but records nothing
    clock.now += 1.0
    assert activity.note([booked], record=False)[0].idle_s == 0.0
    assert activity.note([quiet_a])[0].idle_s == 4.0


def test_among_equal_costs_the_worker_idle_longest_is_the_likeliest_pick():
    """Three cold, equally fast workers: one busy a moment ago, one idle 2 s, one 20 s. The draw
    follows the idle times (a shared LRU's eviction, at random: a burst does not herd)."""
    workers = [
        Candidate(name, f"http://{name}", idle_s=idle) for name, idle in (("fresh", 0.0), ("2s", 2.0), ("20s", 20.0))
    ]
    picks = Counter(
        choose(workers, 64, 16, ScoringWeights(), rng=random.Random(seed)).chosen.worker_id for seed in range(2000)
    )
    assert picks["20s"] > 5 * picks["2s"] > 5 * picks["fresh"] > 0
    assert 0.85 < picks["20s"] / 2000 < 0.95  # 20.05 / (0.05 + 2.05 + 20.05)
    # a worker never seen busy weighs as the bound: with two of them, each about half
    unknown = [Candidate(n, f"http://{n}") for n in ("x", "y")]
    halves = Counter(
        choose(unknown, 64, 16, ScoringWeights(), rng=random.Random(s)).chosen.worker_id for s in range(400)
    )
    assert min(halves.values()) > 150


def test_the_cache_still_comes_before_idleness():
    warm = Candidate("warm", "http://warm", matched_blocks=1, idle_s=0.0)  # 1 of 64 blocks: a tie in cost
    cold = Candidate("cold", "http://cold", idle_s=60.0)
    assert {
        choose([warm, cold], 64, 16, ScoringWeights(), rng=random.Random(s)).chosen.worker_id for s in range(50)
    } == {"warm"}


def test_with_a_home_key_equals_draw_the_same_worker_on_every_replica():
    """A cold prompt's rendezvous: whatever a replica's random state, the prompts whose uncached
    part starts with one block go to one worker among equals; different blocks spread over the
    workers by their idle weights, as the random draw does."""
    workers = [Candidate(name, f"http://{name}", idle_s=idle) for name, idle in (("a", 20.0), ("b", 20.0), ("c", 2.0))]

    def pick(key: int, seed: int) -> str:
        return choose(workers, 64, 16, ScoringWeights(), rng=random.Random(seed), home_key=key).chosen.worker_id

    for key in range(50):
        assert len({pick(key, seed) for seed in range(8)}) == 1
    homes = Counter(pick(key, 0) for key in range(3000))
    assert 0.42 < homes["a"] / 3000 < 0.49 and 0.42 < homes["b"] / 3000 < 0.49  # 20.05 / 42.15 each
    assert 0.03 < homes["c"] / 3000 < 0.08  # 2.05 / 42.15


def test_the_home_key_is_the_first_block_no_worker_holds():
    chain = [11, 12, 13, 14]
    assert home_key(chain, [Candidate("a", "http://a", matched_blocks=2), Candidate("b", "http://b")]) == 13
    assert home_key(chain, [Candidate("a", "http://a")]) == 11
    assert home_key(chain, [Candidate("a", "http://a", matched_blocks=4)]) == 14  # all held: the last
    assert home_key([], [Candidate("a", "http://a")]) is None


def test_among_equals_the_one_with_the_fewest_requests_in_flight_is_drawn():
    """Busy all the time (no idle time tells them apart): the requests in flight do; among the
    least loaded, the idle times weigh the draw."""
    loads = {"none": 0, "also-none": 0, "one": 1, "three": 3}
    idle = {"none": 20.0, "also-none": 2.0, "one": 60.0, "three": 60.0}
    workers = [
        Candidate(name, f"http://{name}", idle_s=idle[name], inflight=InflightLoad(n, 100 * n, 0))
        for name, n in loads.items()
    ]
    picks = Counter(
        choose(workers, 64, 16, ScoringWeights(), rng=random.Random(0), home_key=key).chosen.worker_id
        for key in range(3000)
    )
    assert set(picks) == {"none", "also-none"}
    assert picks["none"] / 3000 == pytest.approx(20.05 / 22.1, abs=0.03)
