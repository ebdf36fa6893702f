"""What a prefix in a worker's lower cache tier is worth (router/routing/tiers.py, scoring): pure."""

from __future__ import annotations

import pytest

from kvindex.types import WorkerLoad
from router.routing.choice import choose
from router.routing.scoring import Candidate, ScoringWeights, score, terms
from router.routing.tiers import TierCosts, TierMode, loadable, parse_tier_values
from router.routing.ttft import CostModel, TtftParams

BS = 16
BLOCKS = 64  # a 1k-token prompt
MODEL = CostModel(fleet=TtftParams(base_s=0.01, per_token_s=30e-6))  # 30 ms per 1k tokens computed


def weights(mode: TierMode = TierMode.TIME, **costs) -> ScoringWeights:
    return ScoringWeights(tiers=TierCosts(mode, **costs))


def test_each_block_past_the_gpus_is_loaded_from_the_fastest_tier_that_holds_it():
    assert loadable((10, 4, 0), 3, 8) == (5, 0, 0)  # the CPU reaches past the prompt: capped
    assert loadable((2, 12, 20), 5, 8) == (0, 3, 0)  # the disk holds more than the CPU
    assert loadable((6, 7, 8), 0, 8) == (6, 1, 1)
    assert loadable((), 3, 8) == () and loadable((0, 0, 0), 8, 8) == (0, 0, 0)


def test_a_cpu_hit_beats_a_cold_worker_and_a_gpu_hit_beats_a_cpu_hit():
    gpu = Candidate("gpu", "u", matched_blocks=BLOCKS)
    cpu = Candidate("cpu", "u", tier_depths=(BLOCKS, 0, 0))
    disk = Candidate("disk", "u", tier_depths=(0, BLOCKS, 0))
    cold = Candidate("cold", "u")
    costs = {c.worker_id: score(c, BLOCKS, BS, weights(), MODEL).cost for c in (gpu, cpu, disk, cold)}
    assert costs["gpu"] < costs["cpu"] < costs["disk"] < costs["cold"]
    # the CPU loads 1k tokens in 4 ms, against 30 ms to compute them: the cost says so, in seconds
    assert costs["cpu"] - costs["gpu"] == pytest.approx(0.004 * BLOCKS * BS / 1000)
    assert choose([cold, cpu], BLOCKS, BS, weights(), model=MODEL).chosen.worker_id == "cpu"


def test_loaded_blocks_are_reported_cached_and_only_the_rest_computed():
    half = Candidate("w", "u", matched_blocks=BLOCKS // 4, tier_depths=(BLOCKS // 2, BLOCKS, 0))
    scored = score(half, BLOCKS, BS, weights(), MODEL)
    assert (scored.hit_blocks, scored.loaded_blocks) == (BLOCKS, 3 * BLOCKS // 4)
    assert scored.prefill_tokens == 0  # nothing left to compute
    cold = score(Candidate("c", "u"), BLOCKS, BS, weights(), MODEL)
    assert cold.prefill_tokens == BLOCKS * BS and cold.hit_blocks == 0


def test_with_tiers_ignored_only_the_gpu_counts_and_with_weights_a_tier_is_a_share_of_a_hit():
    cpu = Candidate("cpu", "u", tier_depths=(BLOCKS, 0, 0))
    cold = Candidate("cold", "u")
    ignored = weights(TierMode.IGNORE)
    assert score(cpu, BLOCKS, BS, ignored, MODEL).cost == score(cold, BLOCKS, BS, ignored, MODEL).cost
    assert score(cpu, BLOCKS, BS, ignored, MODEL).hit_blocks == 0
    fixed = score(cpu, BLOCKS, BS, weights(TierMode.WEIGHTS), MODEL)
    assert fixed.prefill_tokens == pytest.approx(0.25 * BLOCKS * BS)  # CPU = 0.75 of a hit
    assert fixed.hit_blocks == BLOCKS  # the engine still reports them cached


def test_tier_flags_are_checked():
    assert parse_tier_values("cpu=2.5,FS=40", "--tier-load-ms") == {"CPU": 2.5, "DISK": 40.0}
    for bad in ("gpu=1", "tape=1", "cpu=-1", "cpu"):
        with pytest.raises(ValueError, match="--tier-load-ms takes TIER=NUMBER"):
            parse_tier_values(bad, "--tier-load-ms")
    with pytest.raises(ValueError, match="at most 1"):
        TierCosts(weights={"CPU": 1.5})


def test_blocks_loaded_into_a_full_gpu_cache_evict_as_computed_ones_do():
    full = WorkerLoad(running=0, waiting=0, kv_usage=1.0, capacity_blocks=200)
    loading = Candidate("w", "u", engine=full, cached_blocks=200, tier_depths=(BLOCKS, 0, 0))
    t = terms(loading, BLOCKS, BS, MODEL, TierCosts())
    assert t.own == 0 and t.evicted == BLOCKS * BS  # nothing computed, yet the loads take room
