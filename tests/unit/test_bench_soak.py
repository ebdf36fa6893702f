"""The soak's verdict from its samples and counters (pure), and its /proc memory reading."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from kvroute.bench.soak import Process, Samples, _parents, report, tree_rss_bytes
from kvroute.bench.soak_load import ChatLoad, Conversation

ARGS = argparse.Namespace(
    minutes=1.0, rate=10.0, engines=1, routers=1, num_blocks=256, sample_seconds=5.0, warmup=0.5, max_growth_mib=16.0
)


def samples_of(series: dict[str, list[float]]) -> Samples:
    samples = Samples([Process(name, name.split()[0], 0) for name in series])
    count = len(next(iter(series.values())))
    samples.times_s = [5.0 * i for i in range(count)]
    samples.rss_mib = series
    samples.redis_used_memory_mib = [1.0] * count
    samples.requests_ok = list(range(count))
    return samples


def no_errors() -> dict[str, dict[str, int]]:
    return {"agent": {"gaps": 3, "replays": 1}, "router": {"requests": 100, "degraded_decisions": 2}}


def test_growth_during_warm_up_does_not_count_growth_after_it_does():
    warming = [10, 30, 50, 60, 60, 61, 60, 60, 61, 60, 60]  # fills, then flat with noise
    leaking = [60, 60, 60, 60, 60, 60, 70, 80, 90, 100, 110]
    samples = samples_of({"engine 0": warming, "router 0": leaking})
    assert samples.growth_mib("engine 0", 0.5) == 0.0
    assert samples.growth_mib("router 0", 0.5) == 30.0  # median(90, 100, 110) - median(60, 70, 80)
    assert samples.growth_mib("engine 0", 0.0) == 30.0  # no warm-up: the fill counts


def test_one_spike_at_the_end_does_not_decide():
    samples = samples_of({"agent 0": [50, 50, 50, 50, 50, 50, 50, 50, 50, 50, 90]})
    assert samples.growth_mib("agent 0", 0.5) == 0.0


def test_the_verdict_names_each_problem():
    load = ChatLoad(["http://x"], 1.0)
    load.stats.sent = load.stats.ok = 10
    flat = samples_of({"redis": [10.0] * 11, "router 0": [60.0] * 11})
    passed = report(ARGS, flat, load, no_errors(), 60.0)
    assert passed["passed"] and passed["problems"] == []
    assert passed["recoveries"]["agent gaps"] == 3 and passed["recoveries"]["router degraded_decisions"] == 2
    assert passed["errors"]["agent decode_errors"] == 0

    load.stats.fail("status 503", "http://x: 503 no workers")
    leaky = samples_of({"redis": [10.0] * 11, "router 0": [60.0] * 6 + [70, 80, 90, 100, 110]})
    fleet = {"agent": {"redis_errors": 2}, "router": {"requests_5xx": 1}}
    failed = report(ARGS, leaky, load, fleet, 60.0)
    assert not failed["passed"]
    assert failed["problems"] == [
        "1 requests failed",
        "agent redis_errors = 2",
        "router requests_5xx = 1",
        "RSS of router 0 grew +30.0 MiB (bound 16)",
    ]
    assert failed["requests"]["failures"] == {"status 503": 1}
    assert [row["kind"] for row in failed["summary"]] == ["redis", "router"]


def test_a_process_tree_is_measured_with_its_children():
    hold = "import sys; x = b'x' * (64 << 20); print('ready', flush=True); sys.stdin.read()"
    child = subprocess.Popen([sys.executable, "-c", hold], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"  # its 64 MiB are written
        assert tree_rss_bytes(child.pid, {}) >= 64 << 20
        alone = tree_rss_bytes(os.getpid(), {})
        assert tree_rss_bytes(os.getpid(), _parents()) >= alone + (60 << 20)
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait()


def test_a_conversation_grows_by_its_answers_and_is_the_same_for_the_same_number():
    first, again = Conversation.new(7), Conversation.new(7)
    sent = first.next_messages()
    assert sent == again.next_messages() and sent[0]["role"] == "system" and sent[-1]["role"] == "user"
    first.answered(sent)
    assert first.turn == 1 and first.messages[-1]["role"] == "assistant" and len(first.next_messages()) == 4
    assert 2 <= first.turns <= 6
