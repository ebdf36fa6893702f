"""The simulated engine's CPU tier (sim_engine/offload.py): vLLM's native CPU offloading as the
router sees it: every cached block copied to host memory, the prefix past a GPU hit loaded from
there, the events tagged CPU."""

from __future__ import annotations

import time

from kvevents.vllm import BlockRemoved, BlockStored
from sim_engine.engine import SimEngine, SimRequest, TimingModel

BS = 4


def engine(gpu_blocks: int, cpu_blocks: int, load_ms_per_1k: float = 8.0) -> SimEngine:
    timing = TimingModel(speedup=1000.0)
    return SimEngine(gpu_blocks, BS, timing, cpu_blocks=cpu_blocks, cpu_load_ms_per_1k_tokens=load_ms_per_1k)


def run(sim: SimEngine, prompt: list[int]) -> tuple[SimRequest, list]:
    """Serve ``prompt`` to its first token, then to the end: its request and the events published."""
    request = sim.submit(SimRequest(f"r{len(prompt)}-{prompt[0]}", prompt, max_tokens=1))
    events = []
    while not request.finished.is_set():
        plan = sim.schedule()
        events += sim.pool.take_events()
        sim.complete(plan)
    return request, events


def prompt(start: int, blocks: int) -> list[int]:
    return list(range(start, start + blocks * BS + 1))  # blocks full blocks and one token more


def test_cached_blocks_are_copied_to_the_cpu_and_a_prefix_evicted_from_the_gpu_is_loaded_back():
    sim = engine(gpu_blocks=6, cpu_blocks=64)
    _, events = run(sim, prompt(10, 4))
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert [e.medium for e in stored] == ["GPU", "CPU"] and stored[1].block_hashes == stored[0].block_hashes
    run(sim, prompt(500, 4))  # another prompt takes the GPU's room: the first is evicted there
    again, events = run(sim, prompt(10, 4))
    assert again.cached_tokens == 4 * BS and again.external_tokens == 4 * BS  # all of it from the CPU
    assert not any(isinstance(e, BlockStored) and e.medium == "CPU" for e in events)  # held there already
    assert sim.stats.prefix_hits == 0 and sim.cached_prefix_tokens(prompt(10, 4)) == 4 * BS


def test_the_cpu_tier_evicts_least_recently_used_first_and_says_so():
    sim = engine(gpu_blocks=32, cpu_blocks=6)
    run(sim, prompt(10, 4))
    _, events = run(sim, prompt(500, 4))
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert [e.medium for e in removed] == ["CPU"] and len(removed[0].block_hashes) == 2
    assert len(sim.cpu or ()) == 6


def test_a_load_takes_its_time_before_the_request_computes_and_holds_up_no_other():
    sim = engine(gpu_blocks=12, cpu_blocks=64, load_ms_per_1k=1e9)  # a load that lasts (minutes, at 1000x)
    run(sim, prompt(10, 4))
    run(sim, prompt(500, 4))
    run(sim, prompt(900, 4))  # the first prompt is out of the 11-block GPU cache, in the CPU tier
    loading = sim.submit(SimRequest("again", prompt(10, 4), max_tokens=1))
    sim.submit(SimRequest("other", prompt(1300, 1), max_tokens=1))
    plan = sim.schedule()
    assert loading.ready_at > time.monotonic() and loading.num_computed == 4 * BS  # admitted, loading
    assert [r.request_id for r, count in plan.scheduled if count] == ["other"]  # the other computes now
    sim.complete(plan)
    loading.ready_at = 0.0  # its load is over
    plan = sim.schedule()
    assert [(r.request_id, count) for r, count in plan.scheduled if count] == [("again", 1)]
