"""`kvroute bench regimes` as a user runs it: a tiny grid through a self-started stack (real engine,
agent and router processes), and bad arguments."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support import ROOT

RUN_KEYS = {
    "policy",
    "replicas",
    "ttft_mean_ms",
    "ttft_p90_ms",
    "hit_rate",
    "of_lru",
    "prediction_exact",
    "ttft_vs_best",
    "p90_vs_best",
    "hit_vs_best",
    "failed",
    "requests",
}


def regimes(*flags: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "kvroute", "bench", "regimes", *flags]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.slow
def test_a_tiny_grid_streamed_and_not_with_text_prompts(tmp_path):
    """Two cells sharing one stack (text prompts, streamed and not), two policies; sglang is asked
    for without $KVROUTE_SGLANG_PYTHON, so its column is skipped with a note."""
    out, png = tmp_path / "regimes.json", tmp_path / "regimes.png"
    env = {k: v for k, v in os.environ.items() if k != "KVROUTE_SGLANG_PYTHON"}
    result = regimes(
        "--axis",
        "tenants=balanced",
        "--axis",
        "load=heavy",
        "--axis",
        "client=stream,nostream",
        "--axis",
        "prompts=text",
        "--policies",
        "kv,round_robin,sglang",
        "--requests-per-cell",
        "24",
        "--engines",
        "2",
        "--seed",
        "1",
        "--json",
        str(out),
        "--chart",
        str(png),
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "no sglang column: set KVROUTE_SGLANG_PYTHON" in result.stderr
    lines = result.stdout.splitlines()
    for cell in ("balanced/heavy/tight/stream/text/r1", "balanced/heavy/tight/nostream/text/r1"):
        header = next(i for i, line in enumerate(lines) if line.startswith(cell + ":"))
        assert lines[header + 1].split() == [
            "policy",
            "mean",
            "ms",
            "p90",
            "ms",
            "hit",
            "rate",
            "of",
            "LRU",
            "ttft/best",
            "p90/best",
            "hit/best",
            "failed",
            "lost",
            "load/stale/cold",
            "predicted",
            "exact",
        ]
        assert [line.split()[0] for line in lines[header + 2 : header + 4]] == ["kv", "round_robin"]
    assert "latency (not streamed: time to the whole reply)" in result.stdout
    summary = [line for line in lines if line.startswith(("kv: mean within", "round_robin: mean within"))]
    assert len(summary) == 2 and all("/2 cells" in line and "worst mean" in line for line in summary)

    report = json.loads(out.read_text())
    assert report["grid"] == {
        "tenants": ["balanced"],
        "load": ["heavy"],
        "cache": ["tight"],
        "client": ["stream", "nostream"],
        "prompts": ["text"],
        "replicas": ["1"],
        "engine": ["full"],
        "prefill": ["serial"],
        "tiers": ["gpu"],
        "fleet": ["agg"],
    }
    assert [c["metric"] for c in report["cells"]] == ["ttft", "latency"]
    for cell in report["cells"]:
        assert cell["axes"]["tenants"] == "balanced" and cell["axes"]["prompts"] == "text"
        assert 0 < cell["lru_reference_hit_rate"] <= cell["infinite_cache_hit_rate"] <= 1
        assert [r["policy"] for r in cell["runs"]] == ["kv", "round_robin"]
        for run in cell["runs"]:
            assert run.keys() >= RUN_KEYS
            shares = run["lost_share"]  # the router's own split of the cacheable tokens it lost
            assert set(shares) == {"load_tradeoff", "stale_index", "cold"} and all(0 <= v <= 1 for v in shares.values())
            assert 0 <= run["degraded_share"] <= 1  # decisions made without Redis, counted by the routers
            assert 0 <= run["prediction_exact"] <= 1  # x-kvroute-cached-tokens == the engine's cached tokens
            assert run["requests"] == 24 and run["failed"] == 0 and run["replicas"] == 1
            assert 0 < run["hit_rate"] <= cell["infinite_cache_hit_rate"] + 0.01
            assert run["of_lru"] == pytest.approx(run["hit_rate"] / cell["lru_reference_hit_rate"], abs=0.01)
            assert 0 < run["ttft_mean_ms"] <= run["ttft_p90_ms"] * 2 and run["engine_ttft_mean_ms"] > 0
        assert min(r["ttft_vs_best"] for r in cell["runs"]) == 1.0
        assert min(r["p90_vs_best"] for r in cell["runs"]) == 1.0
        assert max(r["hit_vs_best"] for r in cell["runs"]) == 1.0
    # not streamed: the whole reply comes after the engine's first token
    nostream = report["cells"][1]["runs"]
    assert all(r["ttft_mean_ms"] > r["engine_ttft_mean_ms"] for r in nostream)
    assert set(report["summary"]) == {"kv", "round_robin"}
    assert report["summary"]["kv"]["cells"] == 2
    assert png.stat().st_size > 1000


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--axis", "nope=1"], "unknown axis 'nope'"),
        (["--axis", "load=medium"], "unknown load 'medium'"),
        (["--policies", "kv,fastest"], "unknown policy 'fastest'"),
        (["--axis", "prompts=ids", "--policies", "sglang"], "no policy to run"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_status_2(flags, message):
    result = regimes(*flags, timeout=60)
    assert result.returncode == 2
    assert result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("kvroute bench regimes: error: ") and message in line


def test_a_bad_flag_value_is_argparse_s_error():
    result = regimes("--requests-per-cell", "0", timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--requests-per-cell: expected a positive integer, got 0" in result.stderr


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("KVROUTE_SGLANG_PYTHON"),
    reason="set KVROUTE_SGLANG_PYTHON to a Python with sglang-router installed",
)
def test_the_sglang_column_on_text_cells_only(tmp_path):
    out = tmp_path / "regimes.json"
    flags = ["--axis", "tenants=hot", "--axis", "load=light", "--axis", "prompts=ids,text"]
    flags += ["--policies", "kv,sglang", "--requests-per-cell", "24", "--engines", "2", "--json", str(out)]
    result = regimes(*flags)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [[r["policy"] for r in c["runs"]] for c in report["cells"]] == [["kv"], ["kv", "sglang"]]
    assert all(r["failed"] == 0 and r["hit_rate"] > 0 for c in report["cells"] for r in c["runs"])
    assert report["summary"]["sglang"]["cells"] == 1


@pytest.mark.slow
def test_prose_on_engines_that_report_little_against_the_greedy_oracle_over_two_seeds(tmp_path):
    """The chat tenants as text on tiny caches, engines that export three gauges, prefills in
    parallel, at one and two replicas: kv and the greedy oracle (run once per seed, shared by the
    replica counts), judged across the seeds with each figure's range; every request probed first
    (--probe), so each run's hit rate splits by what the engines held at its sends."""
    out, png = tmp_path / "regimes.json", tmp_path / "regimes.png"
    flags = ["--probe", "--axis", "tenants=chat", "--axis", "load=light", "--axis", "cache=tiny"]
    flags += ["--axis", "client=nostream"]
    flags += ["--axis", "prompts=text", "--axis", "engine=minimal", "--axis", "prefill=parallel"]
    flags += ["--axis", "replicas=1,2", "--policies", "kv,greedy_oracle", "--seeds", "1,2"]
    flags += ["--requests-per-cell", "24", "--engines", "2", "--json", str(out), "--chart", str(png)]
    result = regimes(*flags, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    names = [c["name"] for c in report["cells"]]
    assert names == [f"chat/light/tiny/nostream/text/r{r}/minimal/parallel" for s in (1, 2) for r in (1, 2)]
    for cell in report["cells"]:
        assert 1.0 <= cell["prompts_per_engine"] <= 2.0 and cell["engine_kv_tokens"] > cell["mean_prompt_tokens"]
        oracle = next(r for r in cell["runs"] if r["policy"] == "greedy_oracle")
        assert oracle["lost_share"] is None and oracle["failed"] == 0 and oracle["hit_rate"] > 0
        assert 0 <= oracle["prediction_exact"] <= 1  # the oracle says what the engines held when it asked
        for run in cell["runs"]:
            split = run["probe"]
            assert split["known"] == 1.0 and split["hit_rate"] == pytest.approx(run["hit_rate"], abs=1e-3)
            assert split["best"] >= split["hit_rate"] - split["schedule_loss"] - 1e-3
            parts = split["best"] - split["choice_loss"] - split["schedule_loss"]
            assert parts == pytest.approx(split["hit_rate"], abs=2e-3)
        # the oracle sends each prompt to the longest match it sees (it asks just after the probe)
        assert oracle["probe"]["choice_loss"] <= 0.05
    for seed in (0, 2):  # the oracle ran once per seed: the two replica counts share its figures
        one, two = (
            next(r for r in report["cells"][seed + k]["runs"] if r["policy"] == "greedy_oracle") for k in (0, 1)
        )
        assert one["ttft_mean_ms"] == two["ttft_mean_ms"] and (one["replicas"], two["replicas"]) == (1, 2)
    across = report["across_seeds"]
    assert [c["seeds"] for c in across] == [[1, 2], [1, 2]]
    for run in (r for c in across for r in c["runs"]):
        low, high = run["spread"]["of_lru"]
        assert low <= run["of_lru"] <= high and run["runs"] == 2
    assert "seeds' range" in result.stdout and png.stat().st_size > 1000
    assert "at send: best - choice - schedule" in result.stdout
    assert all(run["probe"]["best"] > 0 for c in across for run in c["runs"])
