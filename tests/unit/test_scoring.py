"""The router's scoring (pure)."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest

from kvindex.shared_load import InflightLoad
from kvindex.types import WorkerLoad
from router.routing.choice import choose
from router.routing.scoring import (
    MAX_CONGESTION,
    NO_LOAD,
    Candidate,
    Policy,
    ScoringWeights,
    busy_share,
    cost,
    predicted_cached_tokens,
    queued_requests,
    requests_behind,
)
from router.routing.ttft import CostModel, TtftParams

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


def test_rates_that_differ_by_their_noise_are_ties_and_a_real_difference_is_not():
    """Equal engines whose learned rates differ by a few percent: a cold prompt goes to any of them
    at random (the replicas of a burst do not all pick the same one); an engine 30% faster wins."""
    noisy = {f"w{i}": TtftParams(base_s=0.01, per_token_s=1e-4 * (1 + 0.01 * i)) for i in range(4)}
    model = CostModel(rates=noisy, fleet=TtftParams(base_s=0.01, per_token_s=1e-4))
    cands = [cand(f"w{i}") for i in range(4)]
    picks = Counter(choose(cands, 64, 16, W, rng=random.Random(i), model=model).chosen.worker_id for i in range(400))
    assert set(picks) == {"w0", "w1", "w2", "w3"} and min(picks.values()) > 50
    faster = {**noisy, "w3": TtftParams(base_s=0.01, per_token_s=0.7e-4)}
    model = CostModel(rates=faster, fleet=TtftParams(base_s=0.01, per_token_s=1e-4))
    assert {choose(cands, 64, 16, W, rng=random.Random(i), model=model).chosen.worker_id for i in range(100)} == {"w3"}


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


PER_TOKEN = 1e-4
MODEL = CostModel(fleet=TtftParams(base_s=0.01, per_token_s=PER_TOKEN), typical_uncached_tokens=100, reuse=0.5)


def test_the_cost_is_a_predicted_ttft_over_own_and_queued_prefill():
    c = cand("a", 3, InflightLoad(requests=1, prompt_tokens=160, uncached_tokens=32), WorkerLoad(1, 0, 0.5))
    # own: 7 blocks of 16; ahead: 32 booked uncached tokens; nothing evicted (no capacity known)
    assert cost(c, 10, 16, W, MODEL, marginal=False) == pytest.approx(0.01 + PER_TOKEN * (7 * 16 + 32))
    overrides = ScoringWeights(prefill=1, queued=0.5, active=0.5, queue=4)
    expected = 0.01 + PER_TOKEN * (7 * 16 + 0.5 * 32 + 0.5 * 160 + 4 * 0 * 100)
    assert cost(c, 10, 16, overrides, MODEL, marginal=False) == pytest.approx(expected)
    # The marginal cost adds the own prefill once per request it will delay there: those arriving
    # while the 32 tokens queued ahead and half its own 112 are computed (0.32 + 0.56 of a typical
    # request's 100 tokens, at utilization 1/2)
    marginal = expected + PER_TOKEN * (0.32 + 0.56) * 7 * 16
    assert cost(c, 10, 16, overrides, MODEL) == pytest.approx(marginal)


def test_the_engine_queue_stands_for_typical_requests_when_routers_booked_less():
    waiting = cand("a", 0, InflightLoad(requests=1, prompt_tokens=50, uncached_tokens=50), WorkerLoad(1, 3, 0.5))
    # 3 waiting requests x 100 typical uncached tokens > the 50 booked by routers
    assert cost(waiting, 1, 16, W, MODEL, marginal=False) == pytest.approx(0.01 + PER_TOKEN * (16 + 300))
    # Its own 16 tokens delay the 3 queued there and 0.08 of a request that arrives meanwhile
    assert cost(waiting, 1, 16, W, MODEL) == pytest.approx(0.01 + PER_TOKEN * (16 + 300 + 3.08 * 16))


def test_a_full_cache_charges_what_a_prefill_would_evict_at_the_measured_reuse():
    full = cand("a", 0, engine=WorkerLoad(0, 0, 0.1, capacity_blocks=100))
    full = Candidate(full.worker_id, full.url, 0, NO_LOAD, full.engine, cached_blocks=98)
    roomy = Candidate("b", "u", 0, NO_LOAD, WorkerLoad(0, 0, 0.1, capacity_blocks=100), cached_blocks=10)
    # 10 new blocks: 2 fit in the full cache, 8 evict others' blocks (8 x 16 tokens, reuse 0.5)
    assert cost(full, 10, 16, W, MODEL, marginal=False) == pytest.approx(0.01 + PER_TOKEN * (160 + 0.5 * 8 * 16))
    assert cost(roomy, 10, 16, W, MODEL, marginal=False) == pytest.approx(0.01 + PER_TOKEN * 160)
    assert choose([full, roomy], 10, 16, W, model=MODEL).chosen.worker_id == "b"
    no_pressure = ScoringWeights(cache_pressure=0)
    assert cost(full, 10, 16, no_pressure, MODEL) == pytest.approx(cost(roomy, 10, 16, W, MODEL))


def test_a_warm_worker_keeps_a_conversation_while_its_queue_is_shorter_than_the_prefix():
    prefix = InflightLoad(requests=2, prompt_tokens=800, uncached_tokens=600)
    warm = Candidate("warm", "u", matched_blocks=100, inflight=prefix)  # 1,600 cached tokens, 600 queued
    cold = Candidate("cold", "u")
    assert choose([warm, cold], 110, 16, W, model=MODEL).chosen.worker_id == "warm"
    # One big prompt queued there, more than the prefix saves: the conversation moves.
    deep = InflightLoad(requests=1, prompt_tokens=4000, uncached_tokens=4000)
    one_big = CostModel(fleet=MODEL.fleet, typical_uncached_tokens=4000, reuse=0.5)
    assert choose([Candidate("warm", "u", 100, deep), cold], 110, 16, W, model=one_big).chosen.worker_id == "cold"


def test_a_worker_with_a_queue_charges_the_prefill_a_request_adds_to_those_behind_it():
    # 4,000 queued tokens as 40 typical requests: every token added there delays 40 requests. The
    # conversation's 1,600 cached tokens do not make up for that: it goes to the idle worker.
    deep = InflightLoad(requests=40, prompt_tokens=4000, uncached_tokens=4000)
    warm, cold = Candidate("warm", "u", 100, deep), Candidate("cold", "u")
    assert queued_requests(4000, MODEL) == MAX_CONGESTION
    assert choose([warm, cold], 110, 16, W, model=MODEL).chosen.worker_id == "cold"
    # When every worker has such a queue, moving re-prefills the prefix in front of 40 others.
    busy_cold = Candidate("cold", "u", 0, deep)
    assert choose([warm, busy_cold], 110, 16, W, model=MODEL).chosen.worker_id == "warm"
    # Without the marginal term the greedy choice is the cold worker in both cases... and
    # a hot prefix's holder keeps taking requests until its queue eats the prefix's worth.
    hot = InflightLoad(requests=10, prompt_tokens=1000, uncached_tokens=1000)  # 10 typical requests queued
    holder, idle = Candidate("holder", "u", 64, hot), Candidate("idle", "u")
    greedy = [cost(c, 80, 16, W, MODEL, marginal=False) for c in (holder, idle)]
    assert greedy[0] < greedy[1]  # 1,000 queued < the 1,024-token prefix
    assert choose([holder, idle], 80, 16, W, model=MODEL).chosen.worker_id == "idle"


def test_the_prefix_policy_takes_the_longest_match_and_breaks_ties_by_load():
    loaded = InflightLoad(requests=9, prompt_tokens=9000, uncached_tokens=9000)
    longest = cand("long", 8, loaded)
    assert choose([longest, cand("short", 2)], 10, 16, W, Policy.PREFIX).chosen.worker_id == "long"
    tie = [cand("x", 4, loaded), cand("y", 4, InflightLoad(requests=1))]
    assert choose(tie, 10, 16, W, Policy.PREFIX).chosen.worker_id == "y"


@pytest.mark.parametrize(
    ("matched", "tokens", "expected"), [(3, 70, 48), (4, 64, 48), (4, 65, 64), (0, 10, 0), (1, 1, 0)]
)
def test_predicted_cached_tokens_count_like_vllm(matched, tokens, expected):
    assert predicted_cached_tokens(matched, tokens, 16) == expected


def test_bad_weights_are_rejected():
    with pytest.raises(ValueError, match=">= 0"):
        ScoringWeights(prefill=-1)


def test_queued_prefill_of_this_prompts_own_prefix_is_shared_not_waited_for():
    weights = ScoringWeights()
    queued = InflightLoad(requests=1, prompt_tokens=320, uncached_tokens=320)  # 20 blocks being prefilled
    holder_expected = Candidate("a", "u", matched_blocks=20, inflight=queued, pending_blocks=20)
    holder_unrelated = Candidate("a", "u", matched_blocks=20, inflight=queued)
    idle = Candidate("b", "u")
    assert cost(holder_expected, 20, 16, weights, MODEL) == pytest.approx(0.01)
    assert cost(holder_unrelated, 20, 16, weights, MODEL) == pytest.approx(0.01 + PER_TOKEN * 320)
    assert choose([idle, holder_expected], 20, 16, weights, model=MODEL).chosen.worker_id == "a"
    # Queued work beyond the shared prefix still counts.
    bigger = InflightLoad(requests=2, prompt_tokens=640, uncached_tokens=640)
    bigger_cost = cost(Candidate("a", "u", 20, bigger, pending_blocks=20), 20, 16, weights, MODEL)
    assert bigger_cost == pytest.approx(0.01 + PER_TOKEN * 320)


def test_the_requests_a_prefill_delays_grow_with_the_fleets_utilization():
    light, half, heavy = (replace(MODEL, utilization=u) for u in (0.2, 0.5, 0.8))
    # 300 queued tokens are 3 typical requests; at utilization 1/2 that many will wait behind it
    assert requests_behind(300, half) == pytest.approx(3)
    assert requests_behind(300, light) == pytest.approx(3 * 0.25)  # u / (1 - u)
    assert requests_behind(300, heavy) == pytest.approx(MAX_CONGESTION)  # 12, capped
    assert requests_behind(0, heavy) == 0  # an idle worker and no prefill delay no one
    assert requests_behind(300, replace(MODEL, utilization=1.0)) == MAX_CONGESTION


def test_a_prefill_delays_those_who_arrive_while_it_is_computed_too():
    half = replace(MODEL, utilization=0.5)
    # On an idle worker, 100 tokens of own prefill (one typical request) are under way for a while:
    # on average half of them stand ahead of each arrival meanwhile (the busy period it adds)
    assert requests_behind(0, half, own_tokens=100) == pytest.approx(0.5)
    assert requests_behind(300, half, own_tokens=100) == pytest.approx(3.5)
    assert requests_behind(0, replace(MODEL, utilization=0.2), own_tokens=100) == pytest.approx(0.125)
    # At most one arrival's worth: the routers see the booked prefill and send later ones elsewhere
    assert requests_behind(0, half, own_tokens=10_000) == 1
    assert requests_behind(10_000, half, own_tokens=10_000) == MAX_CONGESTION + 1


def test_a_long_hot_prefix_is_spread_before_its_holders_queue_is_about_twice_the_prefix():
    # An agent's 10,000-token context with 96-token questions: a typical request's uncached part
    # is one question. At utilization 0.9 a copy of the context on an idle worker costs at most
    # twice its prefill; queued 2.2x the context (past the 5% within which costs are ties), the
    # holder spreads it (no herding).
    busy = replace(MODEL, utilization=0.9, typical_uncached_tokens=96)
    context_blocks, prompt_blocks = 625, 631  # blocks of 16 tokens
    queued = InflightLoad(requests=208, prompt_tokens=22_000 * 32, uncached_tokens=22_000)
    holder, idle = Candidate("holder", "u", context_blocks, queued), Candidate("idle", "u")
    assert choose([holder, idle], prompt_blocks, 16, W, model=busy).chosen.worker_id == "idle"
    half_as_much = InflightLoad(requests=104, prompt_tokens=10_000 * 32, uncached_tokens=10_000)
    holder = Candidate("holder", "u", context_blocks, half_as_much)
    assert choose([holder, idle], prompt_blocks, 16, W, model=busy).chosen.worker_id == "holder"


def test_a_conversation_leaves_a_busy_worker_sooner_at_light_load_than_at_heavy_load():
    # The conversation's worker holds 1,600 of its 1,760 tokens; the other worker is idle and
    # holds nothing of it. A typical request's uncached part is 1,500 tokens.
    warm_behind = {n: Candidate("warm", "u", 100, InflightLoad(1, n, n)) for n in (1500, 2250)}
    idle = Candidate("idle", "u")
    typical = replace(MODEL, typical_uncached_tokens=1500)
    light, busy = replace(typical, utilization=0.2), replace(typical, utilization=0.7)
    # One request's prefill ahead: shorter than re-prefilling the conversation; it stays at any load.
    for model in (light, busy):
        assert choose([warm_behind[1500], idle], 110, 16, W, model=model).chosen.worker_id == "warm"
    # 1.5 requests ahead: at light load it moves (its own wait is longer than the re-prefill); in a
    # fleet busy most of the time it stays: the 160 new tokens delay the few queued at the warm
    # worker less than 1,760 on the idle one delay the requests that arrive there meanwhile.
    assert choose([warm_behind[2250], idle], 110, 16, W, model=light).chosen.worker_id == "idle"
    assert choose([warm_behind[2250], idle], 110, 16, W, model=busy).chosen.worker_id == "warm"


def test_the_busy_share_counts_workers_with_prefill_queued():
    queued = InflightLoad(requests=1, prompt_tokens=100, uncached_tokens=50)
    decoding = InflightLoad(requests=1, prompt_tokens=100, uncached_tokens=0)
    cands = [
        cand("a", inflight=queued),
        cand("b", inflight=decoding),
        cand("c", engine=WorkerLoad(1, 2, 0.5)),
        cand("d"),
    ]
    assert busy_share(cands) == pytest.approx(0.5)
    assert busy_share([]) == 0


def _engine(capacity: int | None) -> WorkerLoad:
    return WorkerLoad(running=1, waiting=0, kv_usage=0.5, capacity_blocks=capacity)


def test_matched_blocks_survive_only_what_the_prompts_in_flight_leave_room_for():
    from router.routing.scoring import surviving_blocks

    # 100 blocks, a prompt of 60 blocks in flight there: 100 - 1 - 60 - 1 = 38 blocks of room
    competitor = InflightLoad(requests=1, prompt_tokens=60 * 16, uncached_tokens=60 * 16)
    at_risk = Candidate("w", "http://w", 50, competitor, _engine(100))
    assert surviving_blocks(at_risk, 16) == 38
    # the same prefix held by the request in flight (pinned) survives whole; room for the rest
    assert surviving_blocks(replace(at_risk, held_blocks=20), 16) == 20 + 30
    assert surviving_blocks(replace(at_risk, held_blocks=45), 16) == 45 + 5
    assert surviving_blocks(replace(at_risk, held_blocks=80), 16) == 50  # never more than matched
    # nothing in flight, an unknown cache size, or room for all: the whole match
    assert surviving_blocks(replace(at_risk, inflight=NO_LOAD), 16) == 50
    assert surviving_blocks(replace(at_risk, engine=_engine(None)), 16) == 50
    assert surviving_blocks(replace(at_risk, engine=_engine(1000)), 16) == 50
    # a cache full of prompts in flight keeps only what they hold, as far as the engine's usage says
    crowded = InflightLoad(requests=2, prompt_tokens=120 * 16, uncached_tokens=0)
    full = WorkerLoad(running=2, waiting=0, kv_usage=0.99, capacity_blocks=100)
    assert surviving_blocks(replace(at_risk, inflight=crowded, held_blocks=8, engine=full), 16) == 8
    # fifty prompts in flight sharing one long prefix (summed, 25 times the cache) hold half of it:
    # room for the rest of the match
    shared = InflightLoad(requests=50, prompt_tokens=50 * 50 * 16, uncached_tokens=2 * 16)
    half = WorkerLoad(running=50, waiting=0, kv_usage=0.5, capacity_blocks=100)
    assert surviving_blocks(replace(at_risk, inflight=shared, held_blocks=20, engine=half), 16) == 20 + 30
    # below the cache's size the sum stands (a usage scraped before they were admitted says nothing)
    stale = WorkerLoad(running=0, waiting=0, kv_usage=0.0, capacity_blocks=100)
    assert surviving_blocks(replace(at_risk, engine=stale), 16) == 38


def test_the_cost_and_the_prediction_count_only_the_surviving_blocks():
    competitor = InflightLoad(requests=1, prompt_tokens=60 * 16, uncached_tokens=0)
    at_risk = Candidate("w", "http://w", 50, competitor, _engine(100))
    scored = choose([at_risk], 64, 16, W).ranked[0]
    assert scored.hit_blocks == 38
    assert scored.prefill_tokens == (64 - 38) * 16  # its own prefill: what does not survive


def test_near_ties_keep_the_prompt_where_more_of_it_stays_cached():
    """Costs within TIE_WITHIN are ties; among them the cache decides, then chance (so cold
    prompts of a burst still spread)."""
    model = CostModel()
    warm = cand("warm", 3, InflightLoad(requests=1, prompt_tokens=0, uncached_tokens=40))
    cold = cand("cold", 0)
    costs = [cost(c, 100, 16, W, model) for c in (warm, cold)]
    assert costs[1] <= costs[0] <= costs[1] * 1.05  # a tie, the cold one a hair cheaper
    assert {choose([warm, cold], 100, 16, W, rng=random.Random(seed)).chosen.worker_id for seed in range(20)} == {
        "warm"
    }
    picks = Counter(
        choose([cand("a"), cand("b"), cand("c")], 100, 16, W, rng=random.Random(seed)).chosen.worker_id
        for seed in range(300)
    )
    assert len(picks) == 3 and min(picks.values()) > 60
