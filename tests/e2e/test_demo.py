"""`kvroute demo` as a user runs it: a process that starts everything, reports, and cleans up."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.support import ROOT


def _children_alive(marker: str) -> int:
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return sum(1 for line in out.splitlines() if "worker_agent" in line and marker in line)


@pytest.mark.slow
def test_the_demo_compares_policies_and_cleans_up(tmp_path):
    out = tmp_path / "demo.json"
    chart = tmp_path / "demo.png"
    result = subprocess.run(
        [sys.executable, "-m", "kvroute", "demo", "--conversations", "8", "--turns", "3", "--json", str(out),
         "--chart", str(chart)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {row["policy"]: row for row in json.loads(out.read_text())}
    assert set(rows) == {"kv", "round_robin"}
    assert rows["kv"]["requests"] == rows["round_robin"]["requests"] == 24
    for row in rows.values():  # (which policy wins is measured by the benchmarks, not asserted on 24 requests)
        assert 0 < row["hit_rate"] < 1 and 0 <= row["duplication"] <= 1 and 0 <= row["prediction_accuracy"] <= 1
        assert row["ttft_mean_ms"] > 0 and row["requests_per_s"] > 0
    assert chart.stat().st_size > 1000 and "hit rate" in result.stdout
    assert _children_alive(str(tmp_path)) == 0


@pytest.mark.slow
def test_ctrl_c_stops_everything_the_demo_started(tmp_path):
    process = subprocess.Popen([sys.executable, "-m", "kvroute", "demo", "--chart", str(tmp_path / "x.png")],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 60
    agents = []
    while time.monotonic() < deadline and not agents:
        time.sleep(0.5)
        out = subprocess.run(["ps", "-eo", "pid,ppid,args"], capture_output=True, text=True).stdout
        agents = [line for line in out.splitlines() if "worker_agent" in line and f" {process.pid} " in line]
    assert agents, "the demo started no agents"
    time.sleep(2)
    os.kill(process.pid, signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130 and "stopped" in stderr
    out = subprocess.run(["ps", "-eo", "pid,ppid,args"], capture_output=True, text=True).stdout
    assert not [line for line in out.splitlines() if "worker_agent" in line and f" {process.pid} " in line]


@pytest.mark.slow
def test_bench_replay_runs_a_trace_slice(tmp_path):
    trace = tmp_path / "trace.jsonl"
    rows = [{"timestamp": 100 * i, "input_length": 1500, "output_length": 4, "hash_ids": [0, 1 + i % 3, 10 + i]}
            for i in range(24)]  # fmt: skip
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "replay.json"
    result = subprocess.run(
        [sys.executable, "-m", "kvroute", "bench", "replay", str(trace), "--engines", "2", "--cache-fraction", "1.0",
         "--replicas", "1", "--json", str(out), "--chart", str(tmp_path / "replay.png")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [r["policy"] for r in report["runs"]] == ["kv", "round_robin"]
    assert all(r["failed"] == 0 and r["requests"] == 24 for r in report["runs"])
    assert 0 < report["lru_reference_hit_rate"] <= report["infinite_cache_hit_rate"]
    for run in report["runs"]:
        assert 0 < run["hit_rate"] <= report["infinite_cache_hit_rate"] + 0.01
    assert (tmp_path / "replay.png").stat().st_size > 1000
