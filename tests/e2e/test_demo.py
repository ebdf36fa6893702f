"""`kvroute demo` as a user runs it: a process that starts everything, reports, and cleans up.

Clean-up is checked on the demo's real descendants: every process whose parent chain leads to the
demo is recorded (from /proc) while it runs, and each must be gone once the demo has exited.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support import ROOT

KINDS = {  # what a descendant's command line shows, by kind
    "engine": ("kvroute sim-engine",),
    "agent": ("-m worker_agent",),
    "router": ("-m router",),
    "redis": ("redis-server", "valkey-server"),
}


def _processes() -> dict[int, tuple[int, str, str]]:
    """Every process now: pid -> (parent pid, start time, state), from /proc/<pid>/stat."""
    found = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # it exited while we looked
                continue
            found[int(entry.name)] = (int(fields[1]), fields[19], fields[0])
    return found


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@dataclass
class Descendants:
    """The processes started under ``root`` (at any depth), each known by (pid, start time) so that a
    reused pid is never mistaken for it."""

    root: int
    seen: dict[tuple[int, str], str] = field(default_factory=dict)  # -> command line

    def sample(self) -> None:
        processes = _processes()
        children = defaultdict(list)
        for pid, (parent, _, _) in processes.items():
            children[parent].append(pid)
        pending = [self.root]
        while pending:
            for child in children[pending.pop()]:
                self.seen.setdefault((child, processes[child][1]), _command_line(child))
                pending.append(child)

    def watch_until_exit(self, process: subprocess.Popen[str], within_s: float) -> None:
        """Record descendants until ``process`` exits (a fresh look every 50 ms)."""
        deadline = time.monotonic() + within_s
        while process.poll() is None:
            assert time.monotonic() < deadline, f"the demo did not exit within {within_s} s"
            self.sample()
            time.sleep(0.05)

    def count(self, kind: str) -> int:
        return sum(1 for command in self.seen.values() if any(shows in command for shows in KINDS[kind]))

    def alive(self) -> list[str]:
        processes = _processes()
        return [
            command
            for (pid, started), command in self.seen.items()
            if pid in processes and processes[pid][1] == started and processes[pid][2] != "Z"
        ]

    def kill_leftovers(self) -> None:
        processes = _processes()
        for pid, started in self.seen:
            if pid in processes and processes[pid][1] == started:
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def demo(tmp_path: Path) -> Iterator[tuple[list[str], Path]]:
    """The demo's command line (writing into tmp_path) and where its stderr goes."""
    yield [sys.executable, "-m", "kvroute", "demo", "--chart", str(tmp_path / "demo.png")], tmp_path / "stderr.txt"


def _start(command: list[str], stderr: Path) -> tuple[subprocess.Popen[str], Descendants]:
    with stderr.open("w") as err:
        process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True)
    return process, Descendants(process.pid)


@pytest.mark.slow
def test_the_demo_compares_policies_and_cleans_up(demo, tmp_path):
    command, stderr = demo
    out = tmp_path / "demo.json"
    process, descendants = _start([*command, "--conversations", "8", "--turns", "3", "--json", str(out)], stderr)
    try:
        descendants.watch_until_exit(process, 300)
        assert process.returncode == 0, stderr.read_text()[-3000:]
        rows = {row["policy"]: row for row in json.loads(out.read_text())}
        assert set(rows) == {"kv", "round_robin"}
        assert rows["kv"]["requests"] == rows["round_robin"]["requests"] == 24
        for row in rows.values():  # (which policy wins is measured by the benchmarks, not asserted on 24 requests)
            assert 0 < row["hit_rate"] < 1 and 0 <= row["duplication"] <= 1 and 0 <= row["prediction_accuracy"] <= 1
            assert row["ttft_mean_ms"] > 0 and row["requests_per_s"] > 0 and 0 <= row["turns_moved"] <= 1
            # The routers' split of the lost prefix tokens: shares of the cacheable tokens (docs/dashboard.md).
            lost = row["lost_share"]
            assert set(lost) == {"load_tradeoff", "stale_index", "cold"} and 0 < sum(lost.values()) <= 1
        assert (tmp_path / "demo.png").stat().st_size > 1000 and "hit rate" in process.communicate()[0]
        started = {kind: descendants.count(kind) for kind in KINDS}
        assert started == {"engine": 4, "agent": 4, "router": 4, "redis": 1}, descendants.seen
        assert descendants.alive() == []
    finally:
        descendants.kill_leftovers()


@pytest.mark.slow
def test_ctrl_c_stops_everything_the_demo_started(demo):
    command, stderr = demo
    process, descendants = _start(command, stderr)
    try:
        deadline = time.monotonic() + 120
        while not (descendants.count("router") and "running " in stderr.read_text()):  # the kv run is under way
            assert process.poll() is None and time.monotonic() < deadline, stderr.read_text()[-3000:]
            descendants.sample()
            time.sleep(0.05)  # the next look at /proc and the demo's stderr
        process.send_signal(signal.SIGINT)
        descendants.watch_until_exit(process, 60)
        assert process.returncode == 130 and "stopped" in stderr.read_text()
        assert descendants.count("agent") == 4 and descendants.alive() == []
    finally:
        descendants.kill_leftovers()


def _lines(stream) -> queue.Queue[str]:
    """The lines of ``stream`` as they come ('' at its end), read by a thread: a test can wait for
    one with a deadline."""
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        for line in stream:
            lines.put(line)
        lines.put("")

    threading.Thread(target=read, daemon=True).start()
    return lines


def _json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)


@pytest.mark.slow
def test_keep_serves_live_dashboards_until_ctrl_c(demo):
    command, stderr = demo
    process, descendants = _start([*command, "--conversations", "4", "--turns", "2", "--keep"], stderr)
    try:
        lines, dashboards, seen = _lines(process.stdout), [], []
        deadline = time.monotonic() + 300
        while len(dashboards) < 2:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            assert line, f"the demo's output ended: {stderr.read_text()[-3000:]}"
            seen.append(line)
            if line.strip().endswith("/dashboard"):
                dashboards.append(line.strip())
            descendants.sample()
        assert "lost load/stale/cold" in "".join(seen)  # the table came first
        with urllib.request.urlopen(dashboards[0], timeout=10) as response:
            assert response.status == 200 and b"dashboard.js" in response.read()
        api = dashboards[0] + "/api/"
        assert len(_json(api + "fleet")["models"][0]["workers"]) == 4
        while not _json(api + "accounting")["total"]["accounted"]:  # the kept stack serves live traffic
            assert time.monotonic() < deadline and process.poll() is None, stderr.read_text()[-3000:]
            time.sleep(0.2)  # the next look at the router's own count
        process.send_signal(signal.SIGINT)
        descendants.watch_until_exit(process, 60)
        assert process.returncode == 0 and "stopped" in stderr.read_text()
        assert descendants.count("router") >= 2 and descendants.alive() == []  # the kept routers at least
    finally:
        descendants.kill_leftovers()
