"""Offline references of `kvroute bench replay` (pure)."""

from __future__ import annotations

import itertools

import pytest

from kvroute.bench.replay_workload import (
    SYNTHETIC,
    TRACE_BLOCK,
    TraceRequest,
    reference_hit_rates,
    synthetic_trace,
    tokens_of,
)


def req(*ids: int, length: int | None = None) -> TraceRequest:
    return TraceRequest(0.0, length or TRACE_BLOCK * len(ids), 1, ids)


def test_infinite_cache_counts_every_seen_prefix_and_lru_forgets():
    requests = [req(1, 2), req(3), req(1, 2, 4), req(3)]
    # infinite: r3 hits [1, 2] (1024 tokens), r4 hits [3] but is capped at 511 tokens
    prompt = 1024 + 512 + 1536 + 512
    lru, infinite = reference_hit_rates(requests, capacity_blocks=10)
    assert infinite == (1024 + 511) / prompt == lru
    lru_small, _ = reference_hit_rates(requests, capacity_blocks=2)  # [1, 2] evicted by 3 before r3
    assert lru_small < infinite


def test_tokens_are_deterministic_per_hash_id_and_cut_to_the_input_length():
    a = tokens_of(req(7, 8, length=700), {})
    b = tokens_of(req(7, 9, length=600), {})
    assert len(a) == 700 and len(b) == 600
    assert a[:TRACE_BLOCK] == b[:TRACE_BLOCK] and a[TRACE_BLOCK:600] != b[TRACE_BLOCK:600]


@pytest.mark.parametrize("kind", SYNTHETIC)
def test_synthetic_workloads_share_prefixes(kind):
    requests = synthetic_trace(kind, 300)
    assert len(requests) == 300 and all(b.at_s >= a.at_s for a, b in itertools.pairwise(requests))
    lru, infinite = reference_hit_rates(requests, capacity_blocks=10**6)
    assert 0.3 < infinite <= 1 and lru == infinite


def test_text_prompts_tokenize_block_for_block_like_the_token_ids():
    from kvroute.bench.replay_workload import TextPrompts
    from kvtokens.tokenizer import ModelPrompts
    from sim_engine.settings import TINY_MODEL_DIR

    prompts = ModelPrompts(TINY_MODEL_DIR)
    texts = TextPrompts(prompts)
    a = TraceRequest(0.0, 3 * TRACE_BLOCK - 100, 1, (1, 2, 3))
    b = TraceRequest(0.0, 3 * TRACE_BLOCK, 1, (1, 2, 4))
    ids_a, ids_b = prompts.encode(texts.text_of(a)), prompts.encode(texts.text_of(b))
    assert len(ids_a) == a.input_length and len(ids_b) == b.input_length
    shared = next(i for i, (x, y) in enumerate(zip(ids_a, ids_b, strict=False)) if x != y)
    bos = len(prompts.encode("", True))
    assert shared == bos + 2 * TRACE_BLOCK  # blocks 1 and 2 are shared, after the BOS token
    assert texts.text_of(a) == TextPrompts(prompts).text_of(a)  # deterministic


def test_summary_ratios_and_hit_rate_over_time():
    from kvroute.bench.replay import summarize

    def done(prompt: int, cached: int, ttft: float) -> dict:
        usage = {"prompt_tokens": prompt, "prompt_tokens_details": {"cached_tokens": cached}}
        return {"failed": False, "ttft": ttft, "usage": usage, "worker": "w"}

    results = [done(100, 0, 0.01)] * 20 + [done(100, 50, 0.02)] * 20 + [{"failed": True}]
    run = summarize("kv", 1, results, [30, 10], lru=0.5)
    assert run.failed == 1 and run.requests == 41
    assert run.hit_rate == 0.25 and run.of_lru_reference == 0.5
    assert run.busiest_worker_vs_mean == 1.5
    assert run.hit_rate_over_time[0] == 0.0 and run.hit_rate_over_time[-1] == 0.5
    assert run.ttft_mean_ms == 15.0


def test_repeats_are_averaged_per_router_and_replica_count():
    from kvroute.bench.replay_report import averages, render

    def run(router: str, replicas: int, share: float, ttft: float, repeat: int) -> dict:
        figures = {"hit_rate": share / 2, "of_lru_reference": share, "ttft_mean_ms": ttft, "ttft_p99_ms": 3 * ttft}
        return {"router": router, "replicas": replicas, "repeat": repeat, "busiest_worker_vs_mean": 1.0, **figures}

    runs = [run("kv", 1, 0.9, 100, 0), run("kv", 4, 1.0, 120, 0), run("kv", 1, 1.1, 140, 1), run("kv", 4, 0.8, 80, 1)]
    rows = averages(runs)
    assert [(r["router"], r["replicas"], r["runs"]) for r in rows] == [("kv", 1, 2), ("kv", 4, 2)]
    assert rows[0]["of_lru_reference"] == {"mean": pytest.approx(1.0), "min": 0.9, "max": 1.1}
    assert rows[1]["ttft_mean_ms"] == {"mean": 100, "min": 80, "max": 120}
    results = {
        "requests": 4,
        "prompts": "token ids",
        "engines": 2,
        "cache_fraction": 0.1,
        "distinct_trace_blocks": 10,
        "lru_reference_hit_rate": 0.5,
        "infinite_cache_hit_rate": 0.6,
        "runs": [{**r, "failed": 0, "lost_share": None} for r in runs],
        "averages": rows,
    }
    text = render(results)
    assert "kv            1         2     100.0% (90.0%-110.0%)   120.0 (100.0-140.0)" in text


def test_a_malformed_trace_row_is_named(tmp_path):
    from kvroute.bench.replay_workload import load_trace

    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 600, "hash_ids": [1, 2]}\n{"timestamp": 5, "hash_ids": [1]}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:2: not a Mooncake trace row"):
        load_trace(trace, 10, 10_000)
    assert load_trace(trace, 1, 10_000)[0].hash_ids == (1, 2)
