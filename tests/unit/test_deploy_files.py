"""deploy/grafana/kvroute.json and deploy/prometheus/alerts.yml: well formed, and every metric they
name is one the routers or the agents export (a renamed metric must not leave a silent panel or an
alert that can never fire)."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator

import yaml
from prometheus_client import CollectorRegistry

from kvindex.prefix_memo import PrefixHashMemo
from router.observe.metrics import StateCollector, new_metrics
from router.prompts.hashing import PromptHasher
from router.prompts.token_cache import TokenCache
from router.routing.lookups import Lookups
from tests.support import ROOT
from worker_agent.metrics import AgentCollector, AgentCounters, Gauges, new_registry
from worker_agent.translate import TranslateCounters

GRAFANA = ROOT / "deploy" / "grafana" / "kvroute.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
METRIC = re.compile(r"\bkvroute_(?:router|agent)_[a-z0-9_]+")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def _series_names(registry: CollectorRegistry) -> set[str]:
    """The names a query can use: a counter's ``_total``, a histogram's buckets, sum and count."""
    names = set()
    for family in registry.collect():
        names |= {family.name + suffix for suffix in SUFFIXES.get(family.type, ("",))}
    return names


def exported() -> set[str]:
    async def lookups() -> Lookups:  # its semaphore wants a running loop on Python 3.11
        return Lookups(1, 0.05, 2.0)

    router = new_metrics(StateCollector(asyncio.run(lookups()), PromptHasher(PrefixHashMemo()), TokenCache()))
    agent, _ = new_registry()
    gauges = Gauges(0, 0, 0, True, True, -1)
    agent.register(AgentCollector(AgentCounters(), TranslateCounters, lambda: gauges))
    return _series_names(router.registry) | _series_names(agent)


def grafana_queries() -> Iterator[str]:
    def panels(items: list[dict]) -> Iterator[dict]:
        for panel in items:
            yield panel
            yield from panels(panel.get("panels", []))

    for panel in panels(json.loads(GRAFANA.read_text())["panels"]):
        for target in panel.get("targets", []):
            yield target["expr"]


def alert_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def test_every_metric_the_grafana_dashboard_queries_is_exported():
    names = exported()
    used = {name for query in grafana_queries() for name in METRIC.findall(query)}
    assert used and used - names == set(), sorted(used - names)
    assert {"kvroute_router_lost_prefix_tokens_total", "kvroute_agent_apply_latency_seconds_bucket"} <= used


def test_every_metric_the_alerts_use_is_exported():
    names = exported()
    used = {name for rule in alert_rules() for name in METRIC.findall(rule["expr"])}
    assert used and used - names == set(), sorted(used - names)


def test_the_alerts_cover_what_the_issue_asks_for():
    rules = alert_rules()
    by_name = {rule["alert"]: rule for rule in rules}
    assert len(by_name) == len(rules)  # names are unique
    for needed, metric in {
        "KvrouteRouterDegraded": "kvroute_router_degraded_mode",
        "KvrouteAgentLagging": "kvroute_agent_apply_latency_seconds_bucket",
        "KvrouteAgentSequenceGaps": "kvroute_agent_gaps_total",
        "KvroutePredictionAccuracyFalling": "kvroute_router_predictions_total",
        "KvrouteNoAliveWorker": "kvroute_router_alive_workers",
    }.items():
        assert metric in by_name[needed]["expr"], needed
    for rule in rules:
        assert rule["labels"]["severity"] in {"info", "warning", "critical"} and rule["annotations"]["summary"]


def test_the_grafana_dashboard_is_importable():
    dashboard = json.loads(GRAFANA.read_text())
    assert dashboard["uid"] == "kvroute" and dashboard["templating"]["list"][0]["type"] == "datasource"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]
