"""`kvroute bench index` as a user runs it: on a private single Redis and on a private Redis
Cluster (3 masters, a replica each), small runs, their JSON; a bad combination is one line."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from tests.support import ROOT


def bench_index(*flags: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "kvroute", "bench", "index", *flags]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_a_cluster_run_reports_every_master_and_reads_from_the_replicas(tmp_path):
    out = tmp_path / "index.json"
    flags = ["--cluster", "--read-from-replicas", "--entries", "20000", "--workers", "8", "--roots", "64"]
    flags += ["--queries", "20", "--prompt-blocks", "64", "--seconds", "0.5", "--concurrency", "4", "--json", str(out)]
    result = bench_index(*flags)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())

    shards = report["shards"]
    assert len({s["master"] for s in shards}) == 3
    assert sum(s["entries"] for s in shards) >= 20000
    assert all(s["entries"] > 0 and s["bytes_per_entry"] > 0 and s["keys"] > 0 for s in shards)  # 64 roots spread

    assert sorted(r["reads"] for r in report["match"]) == ["primary", "replicas"]
    assert all(r["p50_ms"] > 0 and r["redis_us_per_match"] > 0 for r in report["match"])
    alive = report["alive"][0]  # liveness read whole, and a reader's copy confirmed by its version
    assert alive["whole_us_per_call"] > 0 and alive["confirmed_us_per_call"] > 0

    runs = {(t["layout"], t["reads"]): t for t in report["throughput"]}
    assert set(runs) == {
        (layout, reads) for layout in ("spread roots", "hot root") for reads in ("primary", "replicas")
    }
    assert all(t["matches_per_s"] > 0 and t["redis_us_per_match"] > 0 for t in runs.values())
    masters = {s["master"] for s in shards}
    for layout in ("spread roots", "hot root"):
        assert set(runs[layout, "primary"]["node_call_share"]) <= masters
        assert not set(runs[layout, "replicas"]["node_call_share"]) & masters  # every read went to a replica
    # the hot root's matches read its segments' buckets, spread over the masters (the layout before
    # pages read one bucket: its shard and the model's control shard only)
    assert len(runs["hot root", "primary"]["node_call_share"]) == 3
    assert all(0 < share < 0.8 for share in runs["hot root", "primary"]["node_cpu_share"].values())


@pytest.mark.slow
def test_a_single_redis_run_counts_the_read_only_scripts(tmp_path):
    out = tmp_path / "index.json"
    flags = ["--entries", "5000", "--workers", "2", "--queries", "20", "--prompt-blocks", "64", "--json", str(out)]
    result = bench_index(*flags)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    cpu = [row["redis_us_per_call"] for row in report["match"]]
    assert cpu and all(math.isfinite(value) and value > 0 for value in cpu)  # EVALSHA_RO is counted
    assert report["ingest_blocks_per_s"] > 0


@pytest.mark.slow
def test_a_trace_run_reports_the_redis_cpu_per_request(tmp_path):
    trace = tmp_path / "trace.jsonl"
    rows = [{"timestamp": i, "input_length": 512 * (2 + i % 3), "hash_ids": [0, i % 7, 100 + i]} for i in range(60)]
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "trace.json"
    flags = ["--trace", str(trace), "--trace-requests", "60", "--trace-workers", "3", "--trace-capacity", "200"]
    result = bench_index(*flags, "--json", str(out))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["requests"] == 48  # the first fifth warms the caches
    assert report["read_script_us_per_request"] > 0 and report["write_script_us_per_request"] > 0
    assert report["script_calls_per_request"] >= 3  # liveness, the match, the write
    assert "us of Redis CPU per request" in result.stdout
    missing = bench_index("--trace", str(tmp_path / "nope.jsonl"), timeout=60)
    assert missing.returncode == 2 and "no such file" in missing.stderr


def test_reading_from_replicas_needs_a_cluster():
    result = bench_index("--read-from-replicas", "--redis-url", "redis://127.0.0.1:1/0", timeout=60)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "--read-from-replicas" in result.stderr


def test_cluster_and_redis_url_are_exclusive():
    result = bench_index("--cluster", "--redis-url", "redis+cluster://127.0.0.1:1", timeout=60)
    assert result.returncode == 2 and "not allowed with" in result.stderr
