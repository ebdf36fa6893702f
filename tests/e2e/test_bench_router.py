"""`kvroute bench router` as a user runs it: only the runs ``--kinds`` asks for, each with its
router's added latency and CPU; a bad run name is one line, exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support import ROOT


def bench_router(*flags: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "kvroute", "bench", "router", *flags]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_only_the_runs_asked_for_are_made():
    result = bench_router("--kinds", "chat", "--requests", "30")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert set(report) == {"kvroute:chat"}  # no pass-through, no --workers 2, no requests/s run
    chat = report["kvroute:chat"]
    assert chat["routed_p50_ms"] > 0 and chat["direct_p50_ms"] > 0 and chat["cpu_us"] > 0
    assert abs(chat["added_p50_ms"] - (chat["routed_p50_ms"] - chat["direct_p50_ms"])) <= 0.002  # rounding


def test_an_unknown_run_is_one_line():
    result = bench_router("--kinds", "chat,warp")
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()  # one line: no usage block above it
    assert line.startswith("kvroute bench router: error: argument --kinds: runs must be some of ")
    assert "got 'chat,warp' (kvroute bench router --help lists the options)" in line
