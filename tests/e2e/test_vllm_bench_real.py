"""`kvroute bench real` on real vLLM servers (the CPU build of .ci/vllm-env, the tiny model): one
cell, two engines, kv and the longest prefix, every figure from the engines' own reports."""

from __future__ import annotations

import json

import pytest

from tests.e2e.test_bench_real import ONE_CELL, bench_real, check_report
from tests.support.vllm import vllm_python

pytestmark = pytest.mark.vllm


def test_one_cell_on_real_vllm_engines(tmp_path):
    vllm_python()  # no environment: the test fails saying so
    out = tmp_path / "real.json"
    result = bench_real(*ONE_CELL, "--clients", "closed", "--policies", "kv,prefix", "--json", str(out), timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    check_report(report, {"ids/tight/closed/r1"}, ["kv", "prefix"])
    assert report["settings"]["engine"] == "vllm"
    for run in report["cells"][0]["runs"]:
        # whole blocks of 32 tokens: vLLM's cached tokens, as its usage reports them
        assert all(cached % 32 == 0 for _, _, _, _, cached, _ in run["sent"])
