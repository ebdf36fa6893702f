"""A decision is a value (router.routing.decision): what later steps read off it are pure
functions over the record, each with its owner (prediction here, the accounting in
router.routing.accounting, the expected prefixes in router.routing.expectations)."""

from __future__ import annotations

from dataclasses import replace

from router.routing.accounting import lost_split, shared_prefix
from router.routing.choice import choose
from router.routing.decision import Decision, elsewhere_ahead, hit_blocks, predicted_cached_tokens, scored_on
from router.routing.expectations import checkpoints, expected_blocks
from router.routing.scoring import Candidate, Policy, ScoringWeights

CHAIN = list(range(100, 110))  # a prompt of ten blocks of 16 tokens, 160 tokens


def _decision(degraded: bool = False) -> Decision:
    candidates = [Candidate("near", "http://near", matched_blocks=8), Candidate("far", "http://far", matched_blocks=2)]
    choice = choose(candidates, len(CHAIN), 16, ScoringWeights(), Policy.PREFIX)
    return Decision("m", 160, 16, CHAIN, choice, degraded, 0.001)


def test_the_prediction_reads_the_chosen_workers_hit():
    decision = _decision()
    near, far = decision.candidates
    assert decision.choice.chosen is near and hit_blocks(decision, near) == 8
    assert predicted_cached_tokens(decision) == 128 == predicted_cached_tokens(decision, near)
    assert predicted_cached_tokens(decision, far) == 32
    assert scored_on(decision, far).candidate is far
    assert elsewhere_ahead(decision, near) == scored_on(decision, far).ahead_tokens == 0


def test_the_accounting_of_a_hit_a_miss_and_a_degraded_decision():
    decision = _decision()
    _, far = decision.candidates
    found = lost_split(decision, reported=128)
    assert found is not None and (found.best_match, found.chosen_match, found.lost_load) == (128, 128, 0)
    moved = lost_split(decision, far, reported=32)
    assert moved is not None and moved.lost_load == 96 and moved.best_other == 128
    assert lost_split(_decision(degraded=True)) is None


def test_the_shared_prefix_is_the_deepest_checkpoint_the_best_worker_held():
    assert shared_prefix(_decision()) == (CHAIN[8 - 1], 128, 1)  # depth 8, held by "near" only
    assert shared_prefix(_decision(degraded=True)) is None
    cold = replace(_decision(), choice=choose([Candidate("x", "http://x")], 10, 16, ScoringWeights()))
    assert shared_prefix(cold) is None


def test_expected_blocks_are_the_prompts_checkpoints():
    assert checkpoints(10) == (1, 2, 4, 8, 10)
    assert expected_blocks(CHAIN) == [CHAIN[0], CHAIN[1], CHAIN[3], CHAIN[7], CHAIN[9]]
    assert expected_blocks([]) == []
