"""The simulated engine's disk tier (sim_engine/offload.py): LMCache's local-disk backend behind
its CPU cache as the router sees it: every cached block written to disk too, the prefix past the
GPU hit loaded from the CPU first, then from the disk where the CPU's run ends
(router.routing.tiers.loadable), the events tagged DISK."""

from __future__ import annotations

import argparse
import time

import pytest

from kvevents.vllm import BlockRemoved, BlockStored
from kvindex.settings import RedisSettings
from kvroute.bench.regimes import _setting
from kvroute.bench.regimes_workload import DISK_LOAD_SHARE, cell_named, grid
from kvroute.devstack.stack import Stack
from router.routing.tiers import loadable
from sim_engine.block_pool import CacheKeys, chain_hashes
from sim_engine.engine import SimEngine, SimRequest, TimingModel
from sim_engine.main import build_parser
from sim_engine.offload import CPU, DISK, CpuTier, DiskTier, LowerTiers
from sim_engine.settings import SimEngineSettings, settings_from_args
from tests.unit.test_sim_offload import BS, prompt, run

SPEEDUP = 1000.0


def engine(gpu_blocks: int, cpu_blocks: int, disk_blocks: int, cpu_ms: float = 8.0, disk_ms: float = 60.0) -> SimEngine:
    return SimEngine(
        gpu_blocks,
        BS,
        TimingModel(speedup=SPEEDUP),
        cpu_blocks=cpu_blocks,
        cpu_load_ms_per_1k_tokens=cpu_ms,
        disk_blocks=disk_blocks,
        disk_load_ms_per_1k_tokens=disk_ms,
    )


def stored_media(events: list) -> list[str | None]:
    return [e.medium for e in events if isinstance(e, BlockStored)]


def test_every_cached_block_is_written_to_the_cpu_and_to_the_disk():
    sim = engine(gpu_blocks=16, cpu_blocks=64, disk_blocks=256)
    _, events = run(sim, prompt(10, 4))
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert stored_media(events) == ["GPU", "CPU", "DISK"]
    assert stored[1].block_hashes == stored[2].block_hashes == stored[0].block_hashes
    assert stored[2].token_ids == stored[0].token_ids and stored[2].parent_block_hash is None
    assert sim.tiers.tiers == (sim.cpu, sim.disk) and len(sim.cpu or ()) == len(sim.disk or ()) == 4


def test_a_disk_tier_without_a_cpu_tier_loads_from_the_gpu_hit():
    sim = engine(gpu_blocks=6, cpu_blocks=0, disk_blocks=64)
    _, events = run(sim, prompt(10, 4))
    assert sim.cpu is None and stored_media(events) == ["GPU", "DISK"]
    run(sim, prompt(500, 4))  # the first prompt leaves the GPU's 5 blocks
    again, events = run(sim, prompt(10, 4))
    assert again.cached_tokens == again.external_tokens == 4 * BS  # all of it from the disk
    assert "DISK" not in stored_media(events)  # held there already
    assert sim.stats.prefix_hits == 0 and sim.stats.prompt_tokens_external == 4 * BS
    assert sim.cached_prefix_tokens(prompt(10, 4)) == 4 * BS


def test_what_the_cpu_lost_is_loaded_from_the_disk():
    sim = engine(gpu_blocks=6, cpu_blocks=6, disk_blocks=64)
    run(sim, prompt(10, 4))
    _, events = run(sim, prompt(500, 4))  # out of the GPU; the CPU drops its first two blocks
    removed = [(e.medium, len(e.block_hashes)) for e in events if isinstance(e, BlockRemoved) and e.medium != "GPU"]
    assert removed == [("CPU", 2)]
    again, _ = run(sim, prompt(10, 4))
    assert again.cached_tokens == again.external_tokens == 4 * BS  # the CPU's run is empty: the disk's
    assert sim.stats.prompt_tokens_external == 4 * BS


def test_the_gpu_hit_then_the_cpu_run_then_the_disk_run_are_loaded_and_waited_for():
    sim = engine(gpu_blocks=16, cpu_blocks=64, disk_blocks=64, cpu_ms=1e6, disk_ms=1e7)
    tokens = prompt(10, 8)
    run(sim, tokens)
    assert sim.reset_prefix_cache() and len(sim.cpu or ()) == len(sim.disk or ()) == 0
    assert sim.cached_prefix_tokens(tokens) == 0
    hashes = chain_hashes(tokens, BS, CacheKeys())
    assert sim.disk is not None and sim.cpu is not None
    sim.disk.store(hashes[:8], tokens, 0, CacheKeys())  # the disk holds all 8 blocks
    sim.cpu.store(hashes[:5], tokens, 0, CacheKeys())  # the CPU the first 5
    sim.pool.take_events()
    sim.cpu.load_ms_per_1k_tokens = sim.disk.load_ms_per_1k_tokens = 0  # the GPU's 2 come quickly
    run(sim, tokens[: 2 * BS + 1])  # (loaded from the CPU, now in the GPU)
    external, hits = sim.stats.prompt_tokens_external, sim.stats.prefix_hits
    sim.cpu.load_ms_per_1k_tokens, sim.disk.load_ms_per_1k_tokens = 1e6, 1e7
    assert sim.cached_prefix_tokens(tokens) == 8 * BS
    assert loadable((5, 8), 2, 8) == (3, 3)  # what the router predicts
    before = time.monotonic()
    again = sim.submit(SimRequest("again", tokens, max_tokens=1))
    plan = sim.schedule()
    # 3 blocks from the CPU at 1e6 ms per 1k tokens, then 3 from the disk at 1e7: 132 s, at 1000x
    wait = (3 * BS * 1e6 + 3 * BS * 1e7) / 1000 / 1000 / SPEEDUP
    assert before + wait <= again.ready_at <= time.monotonic() + wait
    assert again.cached_tokens == 8 * BS and again.external_tokens == 6 * BS and not plan.scheduled[0][1]
    sim.complete(plan)
    again.ready_at = 0.0  # its loads are over
    plan = sim.schedule()
    assert [(r.request_id, count) for r, count in plan.scheduled if count] == [("again", 1)]
    sim.complete(plan)
    assert sim.stats.prompt_tokens_external - external == 6 * BS and sim.stats.prefix_hits - hits == 2 * BS


def test_the_disk_evicts_least_recently_used_first_and_says_so():
    sim = engine(gpu_blocks=32, cpu_blocks=0, disk_blocks=6)
    run(sim, prompt(10, 4))
    _, events = run(sim, prompt(500, 4))
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert [e.medium for e in removed] == ["DISK"] and len(removed[0].block_hashes) == 2
    assert len(sim.disk or ()) == 6


def test_a_run_longer_than_the_tier_keeps_its_last_blocks():
    events: list = []
    tier = DiskTier(3, BS, 30.0, events.append)
    tokens = prompt(10, 5)
    hashes = chain_hashes(tokens, BS, CacheKeys())
    tier.store(hashes, tokens, 0, CacheKeys())
    stored, removed = events
    assert isinstance(stored, BlockStored) and stored.block_hashes == tuple(hashes)
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == tuple(hashes[:2])
    assert len(tier) == 3 and hashes[4] in tier and hashes[0] not in tier


def test_the_tiers_are_kept_in_load_order_and_each_run_starts_where_the_last_ended():
    noop: list = []
    cpu, disk = CpuTier(8, BS, 4.0, noop.append), DiskTier(8, BS, 30.0, noop.append)
    tiers = LowerTiers([disk, cpu])
    assert [t.medium for t in tiers.tiers] == [CPU, DISK] and tiers.of(DISK) is disk
    tokens = prompt(10, 6)
    hashes = chain_hashes(tokens, BS, CacheKeys())
    cpu.store(hashes[:3], tokens, 0, CacheKeys())
    disk.store(hashes[:6], tokens, 0, CacheKeys())
    assert tiers.runs(hashes, 1, 5) == (2, 3) == loadable((3, 6), 1, 6)
    assert tiers.runs(hashes, 1, 3) == (2, 1)  # at most the limit in all
    assert tiers.runs(hashes, 4, 2) == (0, 2) == loadable((3, 6), 4, 6)
    assert tiers.load_ms((2, 3)) == pytest.approx(2 * BS * 4.0 / 1000 + 3 * BS * 30.0 / 1000)
    assert not LowerTiers() and LowerTiers().runs(hashes, 0, 6) == ()


def test_the_disk_settings_flags_environment_and_errors(monkeypatch):
    parser = build_parser()
    settings = settings_from_args(parser.parse_args(["--disk-blocks", "512", "--disk-load-ms-per-1k-tokens", "20"]))
    assert (settings.disk_blocks, settings.disk_load_ms_per_1k_tokens, settings.cpu_blocks) == (512, 20.0, 0)
    default = settings_from_args(parser.parse_args([]))
    assert (default.disk_blocks, default.disk_load_ms_per_1k_tokens) == (0, 30.0)
    monkeypatch.setenv("KVROUTE_SIM_DISK_BLOCKS", "64")
    monkeypatch.setenv("KVROUTE_SIM_DISK_LOAD_MS_PER_1K_TOKENS", "12.5")
    from_env = settings_from_args(build_parser().parse_args([]))
    assert (from_env.disk_blocks, from_env.disk_load_ms_per_1k_tokens) == (64, 12.5)
    assert settings_from_args(build_parser().parse_args(["--disk-blocks", "0"])).disk_blocks == 0
    with pytest.raises(ValueError, match="--disk-blocks and --disk-load-ms-per-1k-tokens must be >= 0"):
        SimEngineSettings(disk_blocks=-1)
    with pytest.raises(ValueError, match="--disk-blocks and --disk-load-ms-per-1k-tokens must be >= 0"):
        SimEngineSettings(disk_blocks=8, disk_load_ms_per_1k_tokens=-1)
    with pytest.raises(ValueError, match="--sliding-window and --disk-blocks cannot be combined"):
        SimEngineSettings(sliding_window=64, disk_blocks=8)
    with pytest.raises(ValueError, match="--kv-transfer cannot be combined with --disk-blocks"):
        SimEngineSettings(kv_transfer=True, disk_blocks=8)
    with pytest.raises(ValueError, match="cannot be combined"):
        SimEngine(8, 4, TimingModel(), sliding_window=8, disk_blocks=8)
    with pytest.raises(ValueError, match="a DISK tier holds at least one block"):
        DiskTier(0, BS, 30.0, print)


def test_a_disk_tier_cell_of_the_regimes_benchmark_has_engines_with_a_disk_and_no_cpu():
    axes, cells = grid(["tiers=disk", "tenants=zipf", "load=heavy"], full=False)
    assert axes["tiers"] == ("disk",) and [c.name for c in cells] == ["zipf/heavy/tight/stream/ids/r1/disk"]
    assert cell_named("zipf/heavy/tight/stream/ids/disk", "1") == cells[0]
    flags = {"requests_per_cell": 60, "seed": 1, "engines": 4, "prefill_ms_per_1k": 50.0, "block_size": 16}
    args = argparse.Namespace(**flags, max_output=8, wall_rate=20.0)
    engine = _setting(cells[0], args).engine
    cpu_cell = cell_named("zipf/heavy/tight/stream/ids/cpu", "1")
    assert "cpu_blocks" not in engine and engine["disk_blocks"] > _setting(cpu_cell, args).engine["cpu_blocks"]
    assert engine["disk_load_ms_per_1k_tokens"] == DISK_LOAD_SHARE * 50.0 == 12.5
    assert engine["num_blocks"] == _setting(cpu_cell, args).engine["num_blocks"]  # the GPU's share as tiers=cpu


def test_the_dev_stack_tells_its_routers_each_tiers_load_time_in_their_clock():
    redis = RedisSettings(url="redis://127.0.0.1:1")
    both = Stack(redis, timing=TimingModel(speedup=4.0), cpu_blocks=8, disk_blocks=16, disk_load_ms_per_1k_tokens=12.5)
    assert both._tier_flags() == ["--tier-load-ms", "CPU=1,DISK=3.125"]
    assert Stack(redis, timing=TimingModel(speedup=2.0), disk_blocks=16)._tier_flags() == ["--tier-load-ms", "DISK=15"]
    assert Stack(redis)._tier_flags() == []
