"""``kvroute bench real``'s workloads and tables (pure)."""

from __future__ import annotations

import argparse
import itertools
import json
from collections import Counter

import pytest

from kvroute.bench.real import RealCell, run_figures
from kvroute.bench.real_report import compare_files, summarize, targets
from kvroute.bench.real_workload import CONVERSATIONS, SYSTEMS, TURNS, WORKLOADS, real_workload
from kvroute.cli.argtypes import non_negative_float
from kvtokens.tokenizer import ModelPrompts
from sim_engine.block_pool import CacheKeys, chain_hashes
from sim_engine.settings import TINY_MODEL_DIR

PROMPTS = ModelPrompts(TINY_MODEL_DIR)


@pytest.mark.parametrize("kind", WORKLOADS)
def test_a_workload_is_its_conversations_turn_after_turn(kind):
    load = real_workload(kind, 1, PROMPTS, 32)
    assert len(load.requests) == SYSTEMS * CONVERSATIONS * TURNS
    assert len(load.conversations) == SYSTEMS * CONVERSATIONS
    assert Counter(load.tenants) == {t: CONVERSATIONS * TURNS for t in range(SYSTEMS)}
    for conversation in load.conversations:
        assert len(conversation) == TURNS
        assert [load.after[i] for i in conversation] == [None, *conversation[:-1]]
        # each turn's prompt extends the last one's: its blocks start with the earlier turn's
        for earlier, later in itertools.pairwise(conversation):
            first, second = load.requests[earlier].hash_ids, load.requests[later].hash_ids
            assert second[: len(first)] == first
    assert 500 < load.mean_prompt_tokens < 1100
    assert max(r.input_length for r in load.requests) < 2016  # what a 64-block vLLM cache serves


def test_the_same_seed_sends_the_same_prompts_and_hashes_them_as_the_engine():
    first, again = (real_workload("chat", 3, PROMPTS, 32) for _ in range(2))
    assert first.prompts == again.prompts and first.requests == again.requests
    assert real_workload("chat", 4, PROMPTS, 32).prompts != first.prompts
    tokens = PROMPTS.chat_tokens(first.prompts[0])
    assert first.requests[0].hash_ids == tuple(chain_hashes(tokens, 32, CacheKeys()))
    assert first.path == "/v1/chat/completions" and first.body(0, 8)["messages"] == first.prompts[0]
    text = real_workload("text", 3, PROMPTS, 32)
    assert text.path == "/v1/completions" and isinstance(text.body(0, 8)["prompt"], str)


def test_a_runs_row_judges_the_engines_reports_against_an_lru_fed_in_send_order():
    load = real_workload("ids", 1, PROMPTS, 32)
    first, second = load.conversations[0][:2]
    results = [
        {"index": first, "sent": 1.0, "failed": False, "latency_s": 0.05, "ttft_s": None, "predicted": 0},
        {"index": second, "sent": 2.0, "failed": False, "latency_s": 0.03, "ttft_s": None, "predicted": 32},
    ]
    results[0] |= {"prompt_tokens": load.requests[first].input_length, "cached_tokens": 0}
    results[1] |= {"prompt_tokens": load.requests[second].input_length, "cached_tokens": 32}
    row = run_figures(results, load, [2, 0, 0, 0], capacity=1000)
    prompt = load.requests[first].input_length + load.requests[second].input_length
    assert row["hit_rate"] == pytest.approx(32 / prompt, abs=1e-4)
    shared = len(load.requests[first].hash_ids) * 32  # an LRU holds the whole first turn
    assert row["lru_reference"] == pytest.approx(shared / prompt, abs=1e-4)
    assert row["busiest_vs_mean"] == 4.0 and row["prediction_exact"] == 1.0


def _cell(name: str, seed: int, runs: dict[str, tuple[float, float]]) -> dict:
    return {
        "cell": name,
        "seed": seed,
        "runs": [
            {
                "policy": policy,
                "hit_rate": hit,
                "of_lru": hit,
                "busiest_vs_mean": busiest,
                "latency_mean_ms": 50.0,
                "failed": 0,
                "lost_share": None,
            }
            for policy, (hit, busiest) in runs.items()
        ],
    }


def test_the_targets_are_judged_on_the_means_over_seeds():
    cells = [
        _cell("ids/tight/closed/r1", 1, {"kv": (0.80, 1.1), "prefix": (0.80, 1.2), "round_robin": (0.5, 1.0)}),
        _cell("ids/tight/closed/r1", 2, {"kv": (0.70, 1.3), "prefix": (0.80, 1.2), "round_robin": (0.5, 1.0)}),
        _cell("ids/tight/closed/r2", 1, {"kv": (0.70, 1.1), "prefix": (0.80, 1.2)}),
    ]
    summary = summarize(cells)
    assert summary["ids/tight/closed/r1"]["kv"]["hit_rate"] == pytest.approx(0.75)
    assert summary["ids/tight/closed/r1"]["kv"]["hit_rate_min"] == 0.70
    verdicts = {(cell, target): verdict for cell, target, verdict in targets(summary)}
    assert verdicts[("ids/tight/closed/r1", "kv >= 0.97x prefix")].startswith("MISSED (0.938x")
    assert verdicts[("ids/tight/closed/r1", "kv >= round_robin")].startswith("met")
    assert verdicts[("ids/tight/closed/r1", "kv busiest <= 1.25x mean")] == "met (1.20x)"
    assert verdicts[("ids/tight/closed/r2", "2 replicas within 2 points of 1")].startswith("MISSED (-5.0")


def test_compare_marks_the_pairs_more_than_three_points_apart(tmp_path):
    real, sim = tmp_path / "real.json", tmp_path / "sim.json"
    base = {"kv": (0.80, 1.0), "prefix": (0.78, 1.0)}
    real.write_text(json.dumps({"summary": summarize([_cell("ids/tight/closed/r1", 1, base)])}))
    off = {"kv": (0.81, 1.0), "prefix": (0.70, 1.0)}
    sim.write_text(json.dumps({"summary": summarize([_cell("ids/tight/closed/r1", 1, off)])}))
    table = compare_files(str(real), str(sim))
    kv, prefix = (line for line in table.splitlines() if line.startswith("ids/"))
    assert "OFF" not in kv and prefix.rstrip().endswith("OFF") and "-8.0" in prefix
    assert table.splitlines()[-1].startswith("1 of 2 (cell, policy) pairs")


def test_a_cells_name_says_its_axes():
    assert RealCell("chat", "roomy", "open", 2).name == "chat/roomy/open/r2"


@pytest.mark.parametrize("value", ["-1", "nan", "x"])
def test_a_negative_or_unreadable_shared_core_count_is_refused(value):
    with pytest.raises(argparse.ArgumentTypeError, match=">= 0"):
        non_negative_float(value)
    assert non_negative_float("0") == 0.0 and non_negative_float("1.5") == 1.5
