"""`kvroute bench real` as a user runs it: one cell through a self-started stack of simulated
engines (the vLLM suite runs it on real vLLM servers: test_vllm_bench_real.py), --compare, and
bad arguments."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT


def bench_real(*flags: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "kvroute", "bench", "real", *flags]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


ONE_CELL = ("--workloads", "ids", "--caches", "tight", "--replicas", "1", "--seeds", "1", "--engines", "2")


def check_report(report: dict, cells: set[str], policies: list[str]) -> None:
    assert {c["cell"] for c in report["cells"]} == cells
    for cell in report["cells"]:
        assert [run["policy"] for run in cell["runs"]] == policies
        for run in cell["runs"]:
            assert run["failed"] == 0 and run["requests"] == 128
            assert sum(run["per_engine"]) == 128  # each engine's own count of finished requests
            assert 0 < run["hit_rate"] <= run["lru_reference"] * 1.3
            assert len(run["sent"]) == 128
    kv = next(run for cell in report["cells"] for run in cell["runs"] if run["policy"] == "kv")
    assert kv["lost_share"] is not None and kv["learned"]["queue_weight"]["used"] >= 0
    assert kv["prediction_exact"] > 0.5


@pytest.mark.slow
def test_one_cell_on_simulated_engines_closed_and_open_loop(tmp_path):
    out = tmp_path / "real.json"
    flags = (*ONE_CELL, "--clients", "closed,open", "--policies", "kv,prefix", "--engine", "sim")
    result = bench_real(*flags, "--json", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    check_report(report, {"ids/tight/closed/r1", "ids/tight/open/r1"}, ["kv", "prefix"])
    assert report["settings"]["engine"] == "sim" and report["settings"]["cache_blocks"] == {"tight": 64}
    assert "ids/tight/closed/r1" in result.stdout and "kv >= 0.97x prefix" in result.stdout
    compared = bench_real("--compare", str(out), str(out))
    assert compared.returncode == 0 and "0 of 4 (cell, policy) pairs" in compared.stdout


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (("--workloads", "ids,prose"), "unknown --workloads value 'prose': choose from ids, text, chat"),
        (("--clients", "closed,burst"), "unknown --clients value 'burst'"),
        (("--caches", "huge"), "unknown --caches value 'huge': choose from tight, roomy"),
        (("--policies", "kv,kv-aware"), "unknown policy 'kv-aware' in --policies"),
        (("--cache-blocks", "tight:64"), "expected NAME=BLOCKS pairs"),
    ],
)
def test_bad_arguments_are_one_line_and_status_2(flags, said):
    result = bench_real("--engine", "sim", *flags, timeout=60)
    assert result.returncode == 2 and said in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_no_vllm_environment_is_said_before_anything_starts(tmp_path):
    env_dir = tmp_path / "nothing-here"
    command = [sys.executable, "-m", "kvroute", "bench", "real", *ONE_CELL]
    env = {"KVROUTE_VLLM_VENV": str(env_dir), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 2, result.stderr
    assert f"no vLLM environment at {env_dir}: run .ci/vllm-env" in result.stderr
    assert not Path(env_dir).exists()
