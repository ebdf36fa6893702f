"""A lower cache tier's load time, learned from the TTFTs of requests that loaded from it
(router/routing/tier_load.py): from the flag's value at first, to what the TTFTs say; the prefill
fit not fooled by the loads; one value for every replica."""

from __future__ import annotations

import random

import pytest

from router.routing.tier_load import PRIOR_OBSERVATIONS, learned_load_s_per_token
from router.routing.ttft import TtftLearner

PRIOR = 4e-6  # the flag's 4 ms per 1k tokens
TRUE_LOAD = 20e-6  # what loading really takes here: 20 ms per 1k tokens
PER_TOKEN = 50e-6  # the engines' prefill: 20k tokens/s
BASE = 0.010


def test_nothing_observed_gives_the_prior_and_nothing_is_ever_negative():
    assert learned_load_s_per_token(None, PRIOR) == PRIOR
    assert learned_load_s_per_token((-100.0, 1.0), PRIOR) == 0.0  # a faster than free load: none


def test_a_few_requests_move_it_little_many_set_it():
    few = (TRUE_LOAD * 2 * 1024.0**2, 2 * 1024.0**2)  # two requests of 1,024 tokens
    assert PRIOR < learned_load_s_per_token(few, PRIOR) < (PRIOR + TRUE_LOAD) / 2
    many = (TRUE_LOAD * 400 * 1024.0**2, 400 * 1024.0**2)
    blended = (400 * TRUE_LOAD + PRIOR_OBSERVATIONS * PRIOR) / (400 + PRIOR_OBSERVATIONS)
    assert learned_load_s_per_token(many, PRIOR) == pytest.approx(blended)
    assert blended == pytest.approx(TRUE_LOAD, rel=0.02)


def feed(learner: TtftLearner, rng: random.Random, count: int) -> None:
    for _ in range(count):
        prefill = rng.uniform(100, 3000)
        seconds = BASE + PER_TOKEN * prefill + rng.gauss(0, 0.002)
        if rng.random() < 0.5:
            loaded = rng.uniform(256, 4096)
            learner.observe("w1", prefill, seconds + TRUE_LOAD * loaded, loaded=("CPU", loaded))
        else:
            learner.observe("w1", prefill, seconds)
    _ = learner.model  # (decisions read it between observations: not needed for the load's sums)


def test_the_learner_finds_the_tiers_load_time_and_keeps_the_prefill_rate():
    learner = TtftLearner()
    feed(learner, random.Random(3), 600)
    model = learner.model
    assert model.tier_load_s_per_token("CPU", PRIOR) == pytest.approx(TRUE_LOAD, rel=0.15)
    assert model.tier_load_s_per_token("DISK", 30e-6) == 30e-6  # nothing loaded from disk: its flag
    assert model.fleet.per_token_s == pytest.approx(PER_TOKEN, rel=0.1)
    assert model.fleet.base_s == pytest.approx(BASE, abs=0.004)
    snapshot = learner.snapshot()["tier_load_ms_per_1k"]["CPU"]
    assert snapshot["measured"] == pytest.approx(TRUE_LOAD * 1e6, rel=0.15) and snapshot["observations"] > 50


def test_every_replica_takes_the_shared_load_time():
    teacher, other = TtftLearner(), TtftLearner()
    feed(teacher, random.Random(5), 400)
    changes = teacher.changes()
    shared = {change.key: change.vector for change in changes}
    assert ("t", "CPU") in shared
    teacher.adopt(changes, shared)
    other.adopt([], shared)
    learned = teacher.model.tier_load_s_per_token("CPU", PRIOR)
    assert other.model.tier_load_s_per_token("CPU", PRIOR) == pytest.approx(learned)
    assert learned == pytest.approx(TRUE_LOAD, rel=0.2)
