"""The simulated engine's scheduler, step by step (vLLM v1's: a token budget per step, chunked
prefill, running requests before waiting ones, the batch limit, preemption), driven through
``SimEngine.schedule`` / ``SimEngine.complete`` without the event loop or the clock."""

from __future__ import annotations

import dataclasses
import random

import pytest

from kvevents.vllm import BlockStored, Event
from sim_engine.block_pool import CacheKeys
from sim_engine.engine import SimEngine, SimRequest, StepPlan, TimingModel
from sim_engine.main import build_parser
from sim_engine.settings import settings_from_args

BS = 4


def make_engine(budget: int, seqs: int = 8, num_blocks: int = 64) -> SimEngine:
    timing = TimingModel(max_num_batched_tokens=budget, max_num_seqs=seqs)
    return SimEngine(num_blocks, BS, timing, max_model_len=4096)


def prompt(n: int, base: int = 10) -> list[int]:
    return [base + i for i in range(n)]


def step(engine: SimEngine) -> tuple[StepPlan, list[Event]]:
    """One step: its plan and the KV events it published."""
    plan = engine.schedule()
    events = engine.pool.take_events()
    engine.complete(plan)
    return plan, events


def stored_tokens(events: list[Event]) -> list[list[int]]:
    return [list(e.token_ids) for e in events if isinstance(e, BlockStored)]


def test_a_long_prompt_is_prefilled_chunk_by_chunk_and_its_blocks_are_stored_as_computed():
    engine = make_engine(budget=8)
    long = engine.submit(SimRequest("long", prompt(30), max_tokens=2))
    chunks, stores, held = [], [], []
    while not long.output:
        plan, events = step(engine)
        chunks.append(plan.tokens_of(long))
        stores.append(stored_tokens(events))
        held.append(len(long.blocks))
    assert chunks == [8, 8, 8, 6]  # min(remaining, budget) per step
    assert stores == [[prompt(30)[0:8]], [prompt(30)[8:16]], [prompt(30)[16:24]], [prompt(30)[24:28]]]
    assert held == [2, 4, 6, 8]  # blocks for the scheduled tokens only (the last one half full)
    assert len(long.output) == 1 and long.num_computed == 30  # the first token: the last chunk's step


def test_chunks_chain_their_blocks_to_the_previous_chunk():
    engine = make_engine(budget=8)
    engine.submit(SimRequest("long", prompt(16), max_tokens=1))
    first, second = (step(engine)[1][0] for _ in range(2))
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
    assert first.parent_block_hash is None and second.parent_block_hash == first.block_hashes[-1]


def test_decodes_are_scheduled_before_new_prefills():
    engine = make_engine(budget=8)
    decoder = engine.submit(SimRequest("decoder", prompt(3), max_tokens=20))
    step(engine)  # its prefill and first token
    long = engine.submit(SimRequest("long", prompt(40, base=100), max_tokens=1))
    for _ in range(3):
        plan, _ = step(engine)
        assert plan.scheduled[0] == (decoder, 1) and plan.tokens_of(long) == 7  # the budget's rest
        assert (plan.decodes, plan.prefill_tokens) == (1, 7)


def test_a_short_prompt_behind_a_long_one_starts_in_the_last_chunks_leftover():
    """First come, first served: a running prefill takes the budget before any waiting request, so
    a short prompt queued behind a long one is not prefilled before the long one's last chunk."""
    engine = make_engine(budget=8)
    long = engine.submit(SimRequest("long", prompt(20), max_tokens=4))
    short = engine.submit(SimRequest("short", prompt(6, base=200), max_tokens=4))
    plans = [step(engine)[0] for _ in range(4)]
    assert [p.tokens_of(long) for p in plans] == [8, 8, 4, 1]
    assert [p.tokens_of(short) for p in plans] == [0, 0, 4, 2]  # 4 = the leftover of the long one's last chunk
    assert len(long.output) == 2 and len(short.output) == 1  # the long one's first token came a step earlier


def test_the_token_budget_and_the_batch_limit_hold_under_load():
    """A random workload on a small cache (preemptions happen): no step exceeds the budget or the
    batch limit; a step that preempts admits nobody; every request finishes with its tokens."""
    rng = random.Random(7)
    engine = make_engine(budget=24, seqs=5, num_blocks=40)
    requests = [
        SimRequest(f"r{i}", [rng.randrange(5, 2000) for _ in range(rng.randrange(1, 90))], rng.randrange(1, 30))
        for i in range(60)
    ]
    pending, steps = list(requests), 0
    while pending or engine.running or engine.waiting:
        for _ in range(rng.randrange(0, 3)):
            if pending:
                engine.submit(pending.pop(0))
        before = {id(r) for r in engine.running}
        plan = engine.schedule()
        assert plan.num_tokens <= 24 and len(engine.running) <= 5
        for request, count in plan.scheduled:
            assert len(request.blocks) * BS >= request.num_computed + count  # slots for what it computes
        if plan.preempted:
            assert all(id(r) in before for r, _ in plan.scheduled)
        engine.pool.take_events()
        engine.complete(plan)
        steps += 1
        assert steps < 10_000
    assert engine.stats.preemptions > 0 and engine.pool.num_free == 39
    assert all(len(r.output) == r.max_tokens and r.finished.is_set() for r in requests)


def test_max_num_seqs_limits_the_batch():
    engine = make_engine(budget=0, seqs=2)
    requests = [engine.submit(SimRequest(f"r{i}", prompt(5, base=10 * i + 10), max_tokens=3)) for i in range(5)]
    plan, _ = step(engine)
    assert [r.request_id for r, _ in plan.scheduled] == ["r0", "r1"] and len(engine.waiting) == 3
    while engine.running or engine.waiting:
        plan, _ = step(engine)
        assert len(plan.scheduled) <= 2
    assert all(len(r.output) == 3 for r in requests)


def test_a_request_preempted_mid_prefill_restarts_from_its_prefix_hit():
    engine = make_engine(budget=4, seqs=2, num_blocks=5)  # 4 usable blocks
    decoder = engine.submit(SimRequest("decoder", prompt(3), max_tokens=6))
    long = engine.submit(SimRequest("long", prompt(12, base=100), max_tokens=1))
    plans = [step(engine)[0] for _ in range(4)]
    assert [p.tokens_of(long) for p in plans[:3]] == [1, 3, 3]  # after the decoder's prefill and decodes
    assert plans[3].preempted == [long] and long.num_preemptions == 1 and engine.waiting[0] is long
    assert engine.pool.cached_block(long.hashes[0]) is not None  # its first block stays cached
    while not (plan := engine.schedule()).tokens_of(long):  # re-admitted once the decoder is done
        engine.complete(plan)
    assert decoder.finished.is_set() and long.num_computed == BS and plan.tokens_of(long) == 4
    engine.complete(plan)
    while not long.output:
        step(engine)
    assert long.cached_tokens == 0  # usage reports the hit when first scheduled, as vLLM
    assert engine.stats.prefix_hits == BS  # the re-admission hit its own first block


@pytest.mark.parametrize("concurrent", [False, True])
def test_a_budget_that_never_binds_reproduces_the_unchunked_engine(concurrent):
    """Budget 0 (none) and a budget no step reaches give the same steps, events, cached tokens and
    outputs; sequential requests need only a budget >= the longest prompt."""
    rng = random.Random(3)
    shared = [rng.randrange(5, 2000) for _ in range(24)]
    prompts = [shared[: rng.randrange(4, 24)] + [rng.randrange(5, 2000) for _ in range(rng.randrange(1, 40))]]
    prompts += [shared + [rng.randrange(5, 2000) for _ in range(rng.randrange(1, 40))] for _ in range(20)]
    longest = max(len(p) for p in prompts)

    def run(budget: int) -> tuple[list, list]:
        engine = make_engine(budget=budget, num_blocks=24)  # evictions
        requests = [SimRequest(f"r{i}", p, max_tokens=5) for i, p in enumerate(prompts)]
        steps = []
        for request in requests:
            engine.submit(request)
            while not concurrent and (engine.running or engine.waiting):
                steps.append(step(engine))
        while engine.running or engine.waiting:
            steps.append(step(engine))
        trace = [([(r.request_id, n) for r, n in plan.scheduled], events) for plan, events in steps]
        return trace, [(r.cached_tokens, r.output) for r in requests]

    unchunked = run(0)
    assert run(10**6) == unchunked
    if not concurrent:
        assert run(longest) == unchunked


def test_timing_model_names_defaults_and_vllms_rules():
    timing = TimingModel()
    assert (timing.max_num_batched_tokens, timing.max_num_seqs, timing.decode_ms_per_token) == (2048, 64, 0.0)
    assert TimingModel(max_running=8) == TimingModel(max_num_seqs=8) and TimingModel(max_running=8).max_running == 8
    assert TimingModel(100, 20, 1, 16, 2).max_num_seqs == 16  # the old positional order still holds
    assert dataclasses.replace(timing, speedup=4).max_num_seqs == 64
    with pytest.raises(ValueError, match="give one of them"):
        TimingModel(max_num_seqs=8, max_running=9)
    with pytest.raises(ValueError, match=r"--max-num-batched-tokens \(8\) must be >= --max-num-seqs \(16\)"):
        TimingModel(max_num_batched_tokens=8, max_num_seqs=16)
    with pytest.raises(ValueError, match="must be >= 0"):
        TimingModel(max_num_batched_tokens=-1)


def test_step_time_model():
    timing = TimingModel(
        prefill_ms_per_1k_tokens=1000, decode_ms_per_step=20, step_overhead_ms=2, speedup=2, decode_ms_per_token=0.5
    )
    assert timing.step_seconds(100, 0) == pytest.approx((2 + 100) / 2000)
    assert timing.step_seconds(100, 8) == pytest.approx((2 + 100 + 20 + 8 * 0.5) / 2000)
    assert TimingModel().step_seconds(0, True) == TimingModel().step_seconds(0, 1)  # the old bool still works


def test_the_command_line_names_and_the_old_alias():
    parser = build_parser()
    old = settings_from_args(parser.parse_args(["--max-running", "8", "--events-endpoint", "none"]))
    new = settings_from_args(parser.parse_args(["--max-num-seqs", "8", "--events-endpoint", "none"]))
    assert old == new and new.timing.max_num_seqs == 8
    args = ["--max-num-batched-tokens", "0", "--decode-ms-per-token", "0.25", "--events-endpoint", "none"]
    timing = settings_from_args(parser.parse_args(args)).timing
    assert (timing.max_num_batched_tokens, timing.decode_ms_per_token) == (0, 0.25)


def test_attention_makes_a_chunk_after_a_long_context_cost_more():
    timing = TimingModel(prefill_ms_per_1k_tokens=18.5, prefill_context_ns=2.0)
    # the H200 figure of issue 37: 992 new tokens after 31,776 cached
    linear = 992 * 18.5 / 1000
    assert timing.chunk_ms(992, 31_776) == pytest.approx(linear + 2.0 * 992 * (31_776 + 496) / 1e6)
    assert timing.chunk_ms(992, 31_776) > 4 * timing.chunk_ms(992, 0) * 0.9
    assert TimingModel(prefill_ms_per_1k_tokens=18.5).chunk_ms(992, 31_776) == pytest.approx(linear)


def test_a_steps_prefill_time_sums_its_chunks_with_their_contexts():
    timing = TimingModel(
        prefill_ms_per_1k_tokens=1000, prefill_context_ns=1e6, max_num_batched_tokens=16, max_num_seqs=8
    )
    engine = SimEngine(64, BS, timing, max_model_len=4096)
    engine.submit(SimRequest("a", prompt(12), max_tokens=1))
    plan, _ = step(engine)  # 12 tokens from 0: 12 ms + 1 ms x 12 x 6
    assert plan.prefill_ms == pytest.approx(12 + 12 * 6)
    engine.submit(SimRequest("b", prompt(24, base=500), max_tokens=1))
    engine.submit(SimRequest("c", prompt(8, base=900), max_tokens=1))
    plan, _ = step(engine)  # a is done; b's first 16 tokens from 0, and the budget is spent
    assert [n for _, n in plan.scheduled] == [16] and plan.prefill_ms == pytest.approx(16 + 16 * 8)
    plan, _ = step(engine)  # b's last 8 after 16 computed, and c's 8 from 0
    assert [n for _, n in plan.scheduled] == [8, 8]
    assert plan.prefill_ms == pytest.approx((8 + 8 * (16 + 4)) + (8 + 8 * 4))
    assert timing.step_seconds(plan.prefill_tokens, 0, plan.prefill_ms) > timing.step_seconds(plan.prefill_tokens, 0)


def test_parallel_prefill_gives_each_request_its_budget_and_takes_the_longest_chunk():
    timing = TimingModel(prefill_ms_per_1k_tokens=1000, max_num_batched_tokens=8, max_num_seqs=8, parallel_prefill=True)
    engine = SimEngine(64, BS, timing, max_model_len=4096)
    for name, base in (("a", 10), ("b", 300), ("c", 600)):
        engine.submit(SimRequest(name, prompt(10, base), max_tokens=1))
    plan, _ = step(engine)
    assert [n for _, n in plan.scheduled] == [8, 8, 8] and plan.prefill_tokens == 24
    assert plan.prefill_ms == pytest.approx(8)  # in parallel: one chunk's time, not three
    plan, _ = step(engine)
    assert [n for _, n in plan.scheduled] == [2, 2, 2] and plan.prefill_ms == pytest.approx(2)
    serial = SimEngine(64, BS, TimingModel(prefill_ms_per_1k_tokens=1000, max_num_batched_tokens=8, max_num_seqs=8))
    for name, base in (("a", 10), ("b", 300)):
        serial.submit(SimRequest(name, prompt(10, base), max_tokens=1))
    plan, _ = step(serial)
    assert [n for _, n in plan.scheduled] == [8] and plan.prefill_ms == pytest.approx(8)


def test_the_prefix_hit_now_is_what_admission_would_give():
    engine = make_engine(budget=0)
    engine.submit(SimRequest("a", prompt(17), max_tokens=1))
    step(engine)
    assert engine.cached_prefix_tokens(prompt(17)) == 16  # at most prompt length - 1, whole blocks
    assert engine.cached_prefix_tokens(prompt(30)) == 16 and engine.cached_prefix_tokens(prompt(9, base=99)) == 0
    assert engine.cached_prefix_tokens(prompt(17), CacheKeys("tenant")) == 0  # a salt is another chain


def test_the_timing_flags():
    parser = build_parser()
    args = ["--prefill-context-ns", "2.5", "--parallel-prefill", "--events-endpoint", "none"]
    timing = settings_from_args(parser.parse_args(args)).timing
    assert (timing.prefill_context_ns, timing.parallel_prefill) == (2.5, True)
    with pytest.raises(ValueError, match="must be >= 0"):
        TimingModel(prefill_context_ns=-1)
