"""The queue's measured price against one's own prefill (router.routing.trade_check; pure)."""

from __future__ import annotations

import random

import pytest

from kvindex.shared_load import InflightLoad
from router.routing.scoring import Candidate, ScoringWeights, score
from router.routing.trade_check import PRIOR_ERROR, PRIOR_WEIGHT, TradeSums
from router.routing.ttft import CostModel, TtftLearner


def _replies(sums: TradeSums, count: int, time_of, seed: int = 0, workers: int = 4) -> None:
    """``count`` replies on a fleet of ``workers``: random queues, prompts and hits; ``time_of``
    gives a reply's seconds from (own, ahead, elsewhere)."""
    rng = random.Random(seed)
    for _ in range(count):
        queues = [rng.choice((0.0, 0.0, rng.uniform(0, 3000))) for _ in range(workers)]
        own = rng.uniform(0, 2000)
        ahead, elsewhere = queues[0], sum(queues[1:])
        sums.add(own, ahead, elsewhere, 0.0, time_of(own, ahead, elsewhere) * rng.uniform(0.9, 1.1))


def test_engines_that_prefill_one_after_another_price_a_queued_token_as_ones_own():
    sums = TradeSums()
    _replies(sums, 400, lambda own, ahead, elsewhere: 0.01 + 1e-4 * (own + ahead))
    weight = sums.queue_weight()
    assert weight.estimate == pytest.approx(1.0, abs=0.1)
    assert 0.7 < weight.used <= 1.0


def test_engines_sharing_their_compute_find_moving_saves_nothing():
    """Every token of prefill anywhere slows every reply alike (engines on one CPU's cores):
    moving off a queue moves the work, not the wait."""
    sums = TradeSums()
    _replies(sums, 400, lambda own, ahead, elsewhere: 0.01 + 1e-4 * own + 3e-5 * (ahead + elsewhere))
    weight = sums.queue_weight()
    assert weight.estimate == pytest.approx(0.0, abs=0.15)
    assert weight.used < 0.15


def test_a_price_not_yet_measured_is_the_priors():
    sums = TradeSums()
    rng = random.Random(1)
    for _ in range(200):  # no queue ever seen: its effect cannot be told
        own = rng.uniform(0, 2000)
        sums.add(own, 0.0, 0.0, 0.0, 0.01 + 1e-4 * own)
    assert sums.queue_weight().estimate is None and sums.queue_weight().used == PRIOR_WEIGHT
    few = TradeSums()
    _replies(few, 5, lambda own, ahead, elsewhere: 0.01 + 1e-4 * own)
    assert few.queue_weight().used == PRIOR_WEIGHT


def test_the_weight_used_leans_on_the_prior_as_much_as_the_measure_is_unsure():
    noisy, clean = TradeSums(), TradeSums()
    rng = random.Random(3)
    for sums, noise in ((noisy, 0.9), (clean, 0.02)):
        for _ in range(100):
            own, ahead = rng.uniform(0, 2000), rng.choice((0.0, rng.uniform(0, 3000)))
            sums.add(own, ahead, 0.0, 0.0, (0.01 + 2e-5 * ahead + 1e-4 * own) * rng.uniform(1 - noise, 1 + noise))
    for sums in (noisy, clean):
        weight = sums.queue_weight()
        precision = PRIOR_ERROR**-2, weight.error**-2
        expected = (precision[0] * PRIOR_WEIGHT + precision[1] * weight.estimate) / sum(precision)
        assert weight.used == pytest.approx(min(max(expected, 0), 1))
    assert noisy.queue_weight().error > 5 * clean.queue_weight().error
    assert clean.queue_weight().used == pytest.approx(0.2, abs=0.05)  # measured: a fifth of one's own
    assert noisy.queue_weight().used > clean.queue_weight().used + 0.1  # unsure: nearer the prior


def test_a_busy_holder_keeps_its_prompt_when_queues_are_free_and_loses_it_when_they_cost():
    """The cost's load terms at the measured price: at 0 the longest prefix wins over an idle
    worker however long the queue on it; at 1 the queue decides, as before."""
    holder = Candidate("holder", "http://h", matched_blocks=40, inflight=InflightLoad(3, 6000, 5000))
    idle = Candidate("idle", "http://i")

    def best(weight: float) -> str:
        model = CostModel(queue_weight=weight)
        costs = {c.worker_id: score(c, 64, 16, ScoringWeights(), model).cost for c in (holder, idle)}
        return min(costs, key=costs.__getitem__)

    assert best(0.0) == "holder"
    assert best(1.0) == "idle"


def test_the_learner_measures_the_price_and_shares_it():
    learner = TtftLearner()
    assert learner.model.queue_weight == PRIOR_WEIGHT
    rng = random.Random(4)
    for _ in range(300):
        own, ahead = rng.uniform(0, 2000), rng.choice((0.0, rng.uniform(0, 3000)))
        seconds = 0.01 + 1e-4 * own + 3e-5 * ahead  # a queued token: 0.3 of one's own
        learner.observe_trade(own, ahead, rng.uniform(0, 5000), 0, seconds * rng.uniform(0.95, 1.05))
    learner.snapshot()
    assert learner.model.queue_weight == pytest.approx(0.3, abs=0.05)
    assert learner.snapshot()["queue_weight"]["used"] == pytest.approx(learner.model.queue_weight, abs=1e-3)
    assert any(change.key == ("Q", "") for change in learner.changes())
