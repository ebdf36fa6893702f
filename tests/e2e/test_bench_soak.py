"""`kvroute bench soak` as a user runs it: a short soak through a self-started stack (Redis, engine,
agent and router processes), its table and JSON; bad arguments are one line, exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support import ROOT

KINDS = ["redis", "engine", "agent", "router"]


def soak(*flags: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "kvroute", "bench", "soak", *flags]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_a_short_soak_reports_every_process_and_no_error(tmp_path):
    out = tmp_path / "soak.json"
    flags = ["--minutes", "0.3", "--engines", "2", "--rate", "4", "--sample-seconds", "2", "--json", str(out)]
    result = soak(*flags)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    table = lines[lines.index(next(line for line in lines if line.startswith("process "))) :][:5]
    assert [row.split()[0] for row in table[1:]] == KINDS
    assert any(line.startswith("requests: ") and " 0 failed" in line for line in lines)
    assert lines[-2] == "PASSED" and lines[-1].startswith("samples written to ")

    report = json.loads(out.read_text())
    requests = report["requests"]
    assert requests["failed"] == 0 and requests["ok"] == requests["sent"] > 0
    assert report["conversations"] > 0 and requests["sent"] > report["conversations"]  # multi-turn
    assert report["passed"] is True and report["problems"] == []
    assert set(report["errors"]) >= {"agent decode_errors", "agent redis_errors", "router requests_5xx"}
    assert all(value == 0 for value in report["errors"].values())

    processes = report["processes"]
    assert sorted(p["kind"] for p in processes) == sorted(["redis"] + ["engine", "agent", "router"] * 2)
    samples = report["samples"]
    count = len(samples["t_s"])
    assert count >= 4 and samples["t_s"] == sorted(samples["t_s"])
    assert set(samples["rss_mib"]) == {p["name"] for p in processes}
    assert all(len(series) == count and min(series) > 1 for series in samples["rss_mib"].values())
    assert len(samples["redis_used_memory_mib"]) == len(samples["requests_ok"]) == count
    assert samples["requests_ok"][-1] == requests["ok"]
    assert [row["kind"] for row in report["summary"]] == KINDS
    assert set(report["rss_growth_mib"]) == set(samples["rss_mib"])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--minutes", "0"], "--minutes: expected a positive number"),
        (["--warmup", "1"], "--warmup must be a fraction in [0, 1)"),
        (["--engines", "x"], "--engines: expected a positive integer"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_status_2(flags, message):
    result = soak(*flags, timeout=60)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr
    assert result.stdout == ""
