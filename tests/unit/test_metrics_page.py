"""The one Prometheus page reader, on a real vLLM 0.32 /metrics page."""

from __future__ import annotations

from kvservice.metrics_page import MetricsPage
from tests.conftest import CAPTURES


def page() -> MetricsPage:
    return MetricsPage.parse((CAPTURES / "run1_metrics.txt").read_text())


def test_values_totals_and_labels_of_a_real_page():
    metrics = page()
    assert metrics.value("vllm:prefix_cache_queries_total") == 826.0
    assert metrics.value("vllm:prefix_cache_queries_total", model_name="other") is None
    assert metrics.value("no_such_metric") is None
    assert metrics.total("vllm:request_success_total") == 8.0
    assert metrics.total("vllm:request_success_total", finished_reason="stop") == 0.0
    by_reason = metrics.by_label("vllm:request_success_total", "finished_reason")
    assert by_reason["length"] == 8.0 and by_reason["stop"] == 0.0
    assert metrics.flat()["vllm:num_requests_running{engine=0,model_name=tiny}"] == 0.0
