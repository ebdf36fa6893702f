"""A lower cache tier's load cost, learned from the TTFTs of requests that loaded from it
(router/routing/tier_load.py): a wait per load and a time per token, from the flag's value at
first to what the TTFTs say; the prefill fit not fooled by the loads; one value for every replica;
priced in the cost only with ``--tier-cost learned``."""

from __future__ import annotations

import random

import pytest

from router.routing.scoring import Candidate, ScoringWeights, score
from router.routing.tier_load import PRIOR_OBSERVATIONS, LoadMoments, TierLoad, learned_load
from router.routing.tiers import TierCosts, TierMode
from router.routing.ttft import CostModel, TtftLearner

PRIOR = 4e-6  # the flag's 4 ms per 1k tokens
TRUE_WAIT = 0.030  # an engine step's wait for each load
TRUE_LOAD = 20e-6  # and 20 ms per 1k tokens
PER_TOKEN = 50e-6  # the engines' prefill: 20k tokens/s
BASE = 0.010


def test_nothing_loaded_gives_the_prior_and_nothing_is_ever_negative():
    assert learned_load(None, 100.0, PRIOR) == TierLoad(0.0, PRIOR)
    faster_than_free = LoadMoments(ii=0.25, il=100.0, ll=1e6, ir=-1.0, lr=-1e4, mean_i=0.5, mean_l=500.0)
    learned = learned_load(faster_than_free, 1000.0, PRIOR)
    assert learned.wait_s >= 0 and learned.per_token_s >= 0
    assert TierLoad(0.01, 1e-5).seconds(0) == 0.0 and TierLoad(0.01, 1e-5).seconds(1000) == pytest.approx(0.02)


def feed(learner: TtftLearner, rng: random.Random, count: int) -> None:
    for _ in range(count):
        prefill = rng.uniform(100, 3000)
        seconds = BASE + PER_TOKEN * prefill + rng.gauss(0, 0.002)
        if rng.random() < 0.5:
            loaded = rng.uniform(256, 4096)
            learner.observe("w1", prefill, seconds + TRUE_WAIT + TRUE_LOAD * loaded, loaded=("CPU", loaded))
        else:
            learner.observe("w1", prefill, seconds)


def test_the_learner_finds_the_wait_and_the_time_per_token_and_keeps_the_prefill_fit():
    learner = TtftLearner(tier_priors={"CPU": PRIOR})
    feed(learner, random.Random(3), 600)
    model = learner.model
    learned = model.tier_load("CPU")
    assert learned is not None
    assert learned.wait_s == pytest.approx(TRUE_WAIT, rel=0.2)
    assert learned.per_token_s == pytest.approx(TRUE_LOAD, rel=0.15)
    assert model.tier_load("DISK") is None  # nothing loaded from disk
    assert model.fleet.per_token_s == pytest.approx(PER_TOKEN, rel=0.1)
    assert model.fleet.base_s == pytest.approx(BASE, abs=0.004)  # the loads' mean is not in it
    shown = learner.snapshot()["tier_loads"]["CPU"]
    assert shown["ms_per_1k_tokens"] == pytest.approx(TRUE_LOAD * 1e6, rel=0.15) and shown["loads"] > 50


def test_a_few_loads_move_it_little_from_the_prior():
    learner = TtftLearner(tier_priors={"CPU": PRIOR})
    feed(learner, random.Random(4), 200)  # ~100 loads for the fit's other terms
    few = TtftLearner(tier_priors={"CPU": PRIOR})
    rng = random.Random(4)
    for _ in range(200):
        prefill = rng.uniform(100, 3000)
        few.observe("w1", prefill, BASE + PER_TOKEN * prefill)
    for _ in range(2):
        few.observe("w1", 1000, BASE + PER_TOKEN * 1000 + TRUE_WAIT + TRUE_LOAD * 1024, loaded=("CPU", 1024))
    learned = few.model.tier_load("CPU")
    assert learned is not None
    assert learned.per_token_s < (PRIOR + TRUE_LOAD) / 2 and learned.wait_s < TRUE_WAIT / 2
    assert PRIOR_OBSERVATIONS > 2


def test_every_replica_takes_the_shared_load_cost():
    teacher, other = TtftLearner(tier_priors={"CPU": PRIOR}), TtftLearner(tier_priors={"CPU": PRIOR})
    feed(teacher, random.Random(5), 400)
    changes = teacher.changes()
    shared = {change.key: change.vector for change in changes}
    assert ("t", "CPU") in shared
    teacher.adopt(changes, shared)
    other.adopt([], shared)
    assert other.model.tier_load("CPU") == teacher.model.tier_load("CPU")


def test_only_learned_mode_prices_the_learned_cost():
    model = CostModel(tier_loads={"CPU": TierLoad(0.05, 0.0)})
    candidate = Candidate("w", "http://w", matched_blocks=0, tier_depths=(10, 0, 0))
    times = {}
    for mode in (TierMode.TIME, TierMode.LEARNED):
        weights = ScoringWeights(tiers=TierCosts(mode=mode, load_ms_per_1k={"CPU": 4.0}))
        times[mode] = score(candidate, 10, 32, weights, model).ttft_s
    # 10 blocks of 32 loaded: 1.28 ms at the flag's 4 ms per 1k, the learned wait of 50 ms
    assert times[TierMode.LEARNED] - times[TierMode.TIME] == pytest.approx(0.05 - 320 * 4e-6, rel=1e-6)
