"""Offline references of `kvroute bench replay` (pure)."""

from __future__ import annotations

import itertools

import pytest

from kvroute.bench_replay import SYNTHETIC, TRACE_BLOCK, TraceRequest, reference_hit_rates, synthetic_trace, tokens_of


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
