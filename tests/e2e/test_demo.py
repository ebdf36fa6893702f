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
