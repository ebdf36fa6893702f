"""The demo's report (kvroute/demo.py render): two tables that fit an 80-column terminal, and kv
against round robin in ratios, the figures that hold from machine to machine."""

from __future__ import annotations

from kvroute.demo import PolicyResult, render


def result(policy: str, hit: float, ttft: float, duplication: float) -> PolicyResult:
    lost = {"load_tradeoff": 0.065, "stale_index": 0.001, "cold": 0.233}
    return PolicyResult(policy, 240, hit, ttft, 3 * ttft, 30.0, duplication, 0.93, 1.36, 0.167, lost)


def test_the_report_fits_80_columns_and_compares_kv_with_round_robin():
    text = render([result("kv", 0.70, 193.6, 0.227), result("round_robin", 0.481, 341.5, 0.719)])
    assert max(len(line) for line in text.splitlines()) <= 80, text
    assert "kv against round robin: hit rate +21.9 points, mean TTFT\n0.57x, duplication 0.32x" in text
    assert "prediction exact" in text and "6.5/0.1/23.3%" in text  # the second table: why


def test_without_both_policies_there_is_no_comparison():
    assert "against" not in render([result("kv", 0.7, 190.0, 0.2)])
