"""`kvroute bench hybrid` as a user runs it: on a private Redis, both ways timed and printed."""

from __future__ import annotations

import re
import subprocess
import sys


def test_the_hybrid_bench_times_the_match_with_and_without_the_window_blocks():
    command = [sys.executable, "-m", "kvroute", "bench", "hybrid", "--workers", "4", "--queries", "20"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("4 workers, a 2048-token prompt")
    timed = dict(re.findall(r"^(match[^:]*): median ([0-9.]+) ms", result.stdout, re.MULTILINE))
    assert set(timed) == {"match alone", "match + window blocks"} and all(float(v) > 0 for v in timed.values())
