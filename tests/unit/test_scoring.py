"""The router's scoring (pure)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from kvindex.types import WorkerLoad
from router.scoring import NO_LOAD, Candidate, Policy, ScoringWeights, choose, cost, predicted_cached_tokens
from router.shared_load import InflightLoad

W = ScoringWeights()


def cand(name: str, matched: int = 0, inflight: InflightLoad = NO_LOAD, engine: WorkerLoad | None = None):
    return Candidate(name, f"http://{name}", matched, inflight, engine)


def test_the_longest_prefix_wins_when_load_is_even():
    choice = choose([cand("a", 2), cand("b", 30), cand("c", 0)], 32, 16, W)
    assert [s.candidate.worker_id for s in choice.ranked] == ["b", "a", "c"]


def test_load_outweighs_a_small_overlap():
    busy_with_prefill = InflightLoad(requests=8, prompt_tokens=8 * 2048, uncached_tokens=8 * 2048)
    choice = choose([cand("warm", 4, busy_with_prefill), cand("cold", 0)], 64, 16, W)
    assert choice.chosen.worker_id == "cold"


def test_busy_workers_are_skipped_unless_all_are_busy():
    full = WorkerLoad(running=10, waiting=0, kv_usage=0.99)
    assert choose([cand("full", 100, engine=full), cand("free", 0)], 100, 16, W).chosen.worker_id == "free"
    assert choose([cand("full", 100, engine=full)], 100, 16, W).chosen.worker_id == "full"


def test_ties_are_broken_at_random_so_replicas_do_not_herd():
    picks = Counter(
        choose([cand("a"), cand("b"), cand("c")], 8, 16, W, rng=random.Random(i)).chosen.worker_id for i in range(300)
    )
    assert set(picks) == {"a", "b", "c"} and min(picks.values()) > 60


def test_temperature_spreads_choices_towards_cheaper_workers():
    weights = ScoringWeights(temperature=1.0)
    picks = Counter(
        choose([cand("a", 10), cand("b", 0)], 10, 16, weights, rng=random.Random(i)).chosen.worker_id
        for i in range(400)
    )
    assert picks["a"] > picks["b"] > 0


def test_other_policies():
    cands = [cand("b", 9), cand("a"), cand("c", inflight=InflightLoad(requests=5))]
    assert [choose(cands, 9, 16, W, Policy.ROUND_ROBIN, turn=t).chosen.worker_id for t in range(4)] == [
        "a",
        "b",
        "c",
        "a",
    ]
    least = choose(cands, 9, 16, W, Policy.LEAST_LOADED, rng=random.Random(1))
    assert least.chosen.worker_id in {"a", "b"} and least.ranked[-1].candidate.worker_id == "c"
    assert {choose(cands, 9, 16, W, Policy.RANDOM, rng=random.Random(i)).chosen.worker_id for i in range(30)} == {
        "a",
        "b",
        "c",
    }


def test_cost_counts_blocks_to_prefill_inflight_kv_and_queue():
    c = cand("a", 3, InflightLoad(requests=1, prompt_tokens=160, uncached_tokens=32), WorkerLoad(1, 2, 0.5))
    assert cost(c, 10, 16, ScoringWeights(prefill=1, queued=0.5, active=0.5, queue=4)) == 7 + 0.5 * 2 + 0.5 * 10 + 4 * 2


@pytest.mark.parametrize(
    ("matched", "tokens", "expected"), [(3, 70, 48), (4, 64, 48), (4, 65, 64), (0, 10, 0), (1, 1, 0)]
)
def test_predicted_cached_tokens_count_like_vllm(matched, tokens, expected):
    assert predicted_cached_tokens(matched, tokens, 16) == expected


def test_bad_weights_are_rejected():
    with pytest.raises(ValueError, match=">= 0"):
        ScoringWeights(prefill=-1)


def test_queued_prefill_of_this_prompts_own_prefix_is_shared_not_waited_for():
    weights = ScoringWeights(active=0.0)
    queued = InflightLoad(requests=1, prompt_tokens=320, uncached_tokens=320)  # 20 blocks being prefilled
    holder_expected = Candidate("a", "u", matched_blocks=20, inflight=queued, pending_blocks=20)
    holder_unrelated = Candidate("a", "u", matched_blocks=20, inflight=queued)
    idle = Candidate("b", "u")
    assert cost(holder_expected, 20, 16, weights) == 0
    assert cost(holder_unrelated, 20, 16, weights) == 0.75 * 20
    assert choose([idle, holder_expected], 20, 16, weights).chosen.worker_id == "a"
    # Queued work beyond the shared prefix still counts.
    bigger = InflightLoad(requests=2, prompt_tokens=640, uncached_tokens=640)
    assert cost(Candidate("a", "u", 20, bigger, pending_blocks=20), 20, 16, weights) == 0.75 * 20
