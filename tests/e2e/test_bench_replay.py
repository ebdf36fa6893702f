"""`kvroute bench replay` as a user runs it: a trace through a self-started stack, text prompts
through routers it did not start, and the SGLang peer when it is installed."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

from kvindex.settings import RedisSettings
from kvroute.devstack.embedded_redis import RedisServer
from kvroute.devstack.stack import Stack
from router.routing.scoring import Policy
from tests.support import ROOT


def _small_trace(tmp_path):
    """24 requests over a shared first block and three second blocks."""
    trace = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 100 * i, "input_length": 1500, "output_length": 4, "hash_ids": [0, 1 + i % 3, 10 + i]}
        for i in range(24)
    ]
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    return trace


@pytest.mark.slow
def test_bench_replay_runs_a_trace_slice(tmp_path):
    trace = _small_trace(tmp_path)
    out = tmp_path / "replay.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvroute",
            "bench",
            "replay",
            str(trace),
            "--engines",
            "2",
            "--cache-fraction",
            "1.0",
            "--replicas",
            "1",
            "--repeats",
            "2",
            "--json",
            str(out),
            "--chart",
            str(tmp_path / "replay.png"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    # --repeats 2: the whole set twice, in turn, and each router's mean over its two runs
    assert [(r["router"], r["repeat"]) for r in report["runs"]] == [
        ("kv", 0),
        ("round_robin", 0),
        ("kv", 1),
        ("round_robin", 1),
    ]
    for row, runs in zip(report["averages"], (report["runs"][0::2], report["runs"][1::2]), strict=True):
        assert row["router"] == runs[0]["router"] and row["runs"] == 2
        assert row["hit_rate"]["mean"] == pytest.approx(sum(r["hit_rate"] for r in runs) / 2)
    assert "over the repeats: mean (min-max)" in result.stdout
    assert all(r["failed"] == 0 and r["requests"] == 24 for r in report["runs"])
    assert 0 < report["lru_reference_hit_rate"] <= report["infinite_cache_hit_rate"]
    for run in report["runs"]:
        assert 0 < run["hit_rate"] <= report["infinite_cache_hit_rate"] + 0.01
    assert (tmp_path / "replay.png").stat().st_size > 1000
    assert all(len(r["hit_rate_over_time"]) >= 10 for r in report["runs"])
    # streamed replies of several tokens: the mean inter-token latency, shorter than a first token
    assert all(0 < r["itl_mean_ms"] < r["ttft_mean_ms"] for r in report["runs"])
    assert all(r["busiest_worker_vs_mean"] >= 1.0 for r in report["runs"])


@pytest.mark.slow
def test_bench_replay_text_prompts_at_fixed_concurrency_through_a_running_router(tmp_path):
    """--router-url: the replay goes through routers it did not start (here a demo-sized stack
    started by the test), with text prompts, 4 at a time."""
    out = tmp_path / "replay.json"

    async def run() -> subprocess.CompletedProcess[str]:
        with RedisServer() as server:
            async with Stack(RedisSettings(url=server.url), engines=2, num_blocks=8192, max_model_len=16384) as stack:
                urls = await stack.start_routers(Policy.KV, 2)
                command = [
                    sys.executable,
                    "-m",
                    "kvroute",
                    "bench",
                    "replay",
                    "--synthetic",
                    "shared-prefix",
                    "--limit",
                    "30",
                    "--prompts",
                    "text",
                    "--concurrency",
                    "4",
                    "--router-url",
                    ",".join(urls),
                    "--json",
                    str(out),
                    "--chart",
                    str(tmp_path / "replay.png"),
                ]
                process = await asyncio.create_subprocess_exec(*command, cwd=ROOT, stderr=asyncio.subprocess.PIPE)
                _, stderr = await asyncio.wait_for(process.communicate(), 300)
                return subprocess.CompletedProcess(command, process.returncode or 0, "", stderr.decode())

    result = asyncio.run(run())
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["prompts"] == "text"
    (run_,) = report["runs"]
    assert run_["router"] == "external" and run_["replicas"] == 2 and run_["requests"] == 30 and run_["failed"] == 0
    assert 0.5 * report["infinite_cache_hit_rate"] < run_["hit_rate"] <= report["infinite_cache_hit_rate"] + 0.01


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("KVROUTE_SGLANG_PYTHON"),
    reason="set KVROUTE_SGLANG_PYTHON to a Python with sglang-router installed",
)
def test_bench_replay_with_the_sglang_peer(tmp_path):
    out = tmp_path / "replay.json"
    command = [
        sys.executable,
        "-m",
        "kvroute",
        "bench",
        "replay",
        "--synthetic",
        "shared-prefix",
        "--limit",
        "24",
        "--engines",
        "2",
        "--replicas",
        "1,2",
        "--policies",
        "kv",
        "--peer",
        "sglang",
        "--json",
        str(out),
        "--chart",
        str(tmp_path / "replay.png"),
    ]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [(r["router"], r["replicas"]) for r in report["runs"]] == [
        ("kv", 1),
        ("sglang", 1),
        ("kv", 2),
        ("sglang", 2),
    ]
    assert report["prompts"] == "text" and all(r["failed"] == 0 and r["hit_rate"] > 0 for r in report["runs"])


@pytest.mark.slow
def test_bench_replay_with_the_greedy_oracle_beside_kv(tmp_path):
    """--peer greedy_oracle: the reference that asks each engine what it holds runs on the same
    engines as kv, with token ids (it takes them as well as text), and predicts what it saw; with
    --probe every run's hit rate splits by what the engines held at each send."""
    trace = _small_trace(tmp_path)
    out = tmp_path / "replay.json"
    flags = ["--engines", "2", "--cache-fraction", "1.0", "--replicas", "1", "--peer", "greedy_oracle", "--probe"]
    command = [sys.executable, "-m", "kvroute", "bench", "replay", str(trace), *flags, "--json", str(out)]
    command += ["--chart", str(tmp_path / "replay.png")]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["prompts"] == "token ids"
    assert [r["router"] for r in report["runs"]] == ["kv", "round_robin", "greedy_oracle"]
    oracle = report["runs"][-1]
    assert oracle["failed"] == 0 and oracle["lost_share"] is None and 0 <= oracle["prediction_exact"] <= 1
    # the same engines, all prefixes fit: the oracle is at the shared-LRU reference, give or take
    assert oracle["of_lru_reference"] > 0.8
    for run in report["runs"]:
        split = run["probe_split"]
        assert split["known"] == 1.0 and split["hit_rate"] == pytest.approx(run["hit_rate"], abs=1e-3)
        parts = split["best"] - split["choice_loss"] - split["schedule_loss"]
        assert parts == pytest.approx(split["hit_rate"], abs=2e-3)
    assert oracle["probe_split"]["choice_loss"] <= 0.05  # it asks just after the probe: the longest match
    assert "at send: best - choice - schedule" in result.stdout
