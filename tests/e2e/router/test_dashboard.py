"""The dashboard and the decision-quality accounting against a real router, real Redis, simulated
engines and agent processes; the page rendered by a real headless Chromium.

The browser is found on PATH (Debian's ``chromium``; ``.ci/run`` installs it); without one the
browser test skips and says why. ``KVROUTE_DASHBOARD_SCREENSHOT=path`` also writes the rendered
page's screenshot there (docs/img/dashboard.png is made this way).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvservice.logs import FIELDS
from router.main import RunningRouter
from router.routing.scoring import Policy
from tests.support import wait_for_workers, wait_until
from tests.support.browser import NO_BROWSER, chromium, find_browser
from tests.support.router import PREFIX, complete, start_router, wait_indexed

SVG_NAMESPACE = "http://www.w3.org/2000/svg"
SPLIT_FIELDS = ("best_match_tokens", "lost_load_tokens", "lost_stale_tokens", "cold_tokens")


async def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session, session.get(url, headers=headers) as response:
        return response.status, await response.json(content_type=None)


async def _lost_tokens(router: RunningRouter) -> dict[str, float]:
    async with aiohttp.ClientSession() as session, session.get(router.url + "/metrics") as response:
        text = await response.text()
    return {
        sample.labels["reason"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "kvroute_router_lost_prefix_tokens_total"
    }


async def _samples(router: RunningRouter, *names: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as session, session.get(router.url + "/metrics") as response:
        text = await response.text()
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names:
                found[sample.name] = found.get(sample.name, 0.0) + sample.value
    return found


async def _shared_prefix_traffic(router: RunningRouter, requests: int) -> str:
    """One request that makes a worker compute PREFIX, then ``requests`` more sharing it; the owner."""
    status, _, _ = await complete(router.url, [*PREFIX, 1])
    assert status == 200
    owner = await wait_indexed(router, PREFIX)
    for tail in range(2, 2 + requests):
        assert (await complete(router.url, [*PREFIX, tail, tail]))[0] == 200
    return owner


def _access_records(caplog) -> list[dict]:
    return [getattr(r, FIELDS) for r in caplog.records if r.name == "router.access" and hasattr(r, FIELDS)]


async def test_the_split_reaches_metrics_access_log_debug_route_and_the_json(router, caplog):
    caplog.set_level(logging.INFO, logger="router.access")
    await _shared_prefix_traffic(router, 4)
    # The first request: nobody held PREFIX (160 cacheable tokens, all cold); the next 4 found it
    # where they went, and the engine had what the index said.
    assert await _lost_tokens(router) == {"load_tradeoff": 0.0, "stale_index": 0.0, "cold": 160.0}
    logged = [r for r in _access_records(caplog) if r["path"] == "/v1/completions"]
    assert [r["cold_tokens"] for r in logged] == [160, 0, 0, 0, 0]
    assert all(r["best_match_tokens"] == r["predicted_cached_tokens"] == 160 for r in logged[1:])
    assert all(r["lost_load_tokens"] == 0 and r["lost_stale_tokens"] == 0 for r in logged)

    status, accounting = await _get(router.url + "/dashboard/api/accounting")
    total = accounting["total"]
    assert status == 200 and total["accounted"] == total["decisions"] == 5
    assert total["cacheable"] == 5 * 160 and total["cold"] == 160 and total["reported_cached"] == 4 * 160
    assert total["hit_rate"] == round(640 / (161 + 4 * 162), 4)
    assert total["lost_share"] == {"load_tradeoff": 0.0, "stale_index": 0.0, "cold": 0.2}
    assert len(accounting["series"]) == accounting["window_s"] / accounting["bucket_s"]
    (role,) = accounting["by_role"]  # complete engines only: every split charged to "both"
    both = accounting["by_role"]["both"]
    assert role == "both" and (both["accounted"], both["cacheable"], both["cold"]) == (5, 5 * 160, 160)

    # /debug/route explains the split of the next decision, and changes nothing.
    async with (
        aiohttp.ClientSession() as session,
        session.post(router.url + "/debug/route", json={"model": "tiny", "prompt": [*PREFIX, 9]}) as response,
    ):
        explained = await response.json()
    assert {k: explained[k] for k in SPLIT_FIELDS} == {
        "best_match_tokens": 160,
        "lost_load_tokens": 0,
        "lost_stale_tokens": None,  # no engine answered: unknown, not 0
        "cold_tokens": 0,
    }
    assert (await _get(router.url + "/dashboard/api/accounting"))[1]["total"]["decisions"] == 5

    status, prefixes = await _get(router.url + "/dashboard/api/prefixes")
    assert status == 200 and prefixes["prefixes"][0]["hits"] == 4 and prefixes["prefixes"][0]["holders"] >= 1


async def test_round_robin_gives_up_matches_and_says_so(fleet, redis_server):
    context, rr = await start_router(redis_server.url, policy=Policy.ROUND_ROBIN)
    try:
        await wait_for_workers(rr, fleet.count)
        await _shared_prefix_traffic(rr, fleet.count)
        # Of the next turns over the 3 workers, the first sent elsewhere than the owner found
        # PREFIX only on the owner: 160 tokens given up for load.
        lost = await _lost_tokens(rr)
        assert lost["load_tradeoff"] >= 160 and lost["cold"] == 160
        # and the requests sent away from the owner are regretted: the owner held PREFIX, the
        # engine they went to served none of it
        regret = await _samples(rr, "kvroute_router_regretted_requests_total", "kvroute_router_regret_ratio")
        assert regret["kvroute_router_regretted_requests_total"] >= 1
        assert 0 < regret["kvroute_router_regret_ratio"] <= 1
        _, accounting = await _get(rr.url + "/dashboard/api/accounting")
        total = accounting["total"]
        assert total["regretted"] == regret["kvroute_router_regretted_requests_total"]
        assert total["regret_share"] == round(total["regretted"] / total["reported_requests"], 4)
    finally:
        await context.__aexit__(None, None, None)  # type: ignore[attr-defined]


async def test_the_fleet_json_names_every_worker_and_its_load(router):
    view: dict = {}

    async def engines_scraped() -> bool:  # the agents report their engine's load within a few seconds
        status, got = await _get(router.url + "/dashboard/api/fleet")
        view.update(got)
        return status == 200 and all(w["kv_usage"] is not None for m in got["models"] for w in m["workers"])

    await wait_until(engines_scraped, 20)
    assert view["redis"] is True and view["degraded"] is False
    (model,) = view["models"]
    expected = sorted(w.worker_id for w in router.state.fleet.alive("tiny"))
    assert model["model"] == "tiny" and model["inflight_scope"] == "fleet"
    assert sorted(w["id"] for w in model["workers"]) == expected
    for worker in model["workers"]:
        assert worker["inflight_requests"] == 0 and worker["capacity_blocks"] == 256
        assert 0 <= worker["kv_usage"] <= 1 and "url" not in worker
        assert worker["role"] == "both"  # agents told no role: complete engines


async def test_with_api_keys_the_json_needs_the_key_and_the_page_does_not(fleet, redis_server):
    context, keyed = await start_router(redis_server.url, api_keys=frozenset({"secret-key"}))
    try:
        await wait_for_workers(keyed, fleet.count)
        async with aiohttp.ClientSession() as session:
            async with session.get(keyed.url + "/dashboard") as response:
                assert response.status == 200 and "kvroute" in await response.text()
            async with session.get(keyed.url + "/dashboard/api/fleet") as response:
                assert response.status == 401
        status, _ = await _get(keyed.url + "/dashboard/api/fleet", {"Authorization": "Bearer secret-key"})
        assert status == 200
    finally:
        await context.__aexit__(None, None, None)  # type: ignore[attr-defined]


async def test_the_page_loads_nothing_from_elsewhere(router):
    async with aiohttp.ClientSession() as session:
        for name in ("", "/dashboard.js", "/dashboard.css"):
            async with session.get(router.url + "/dashboard" + name) as response:
                assert response.status == 200
                text = (await response.text()).replace(SVG_NAMESPACE, "")  # a name, never fetched
            assert not re.search(r"(https?:)?//[a-z0-9]", text, re.IGNORECASE), name  # same origin only


async def test_a_real_browser_renders_the_workers_and_the_hit_rate(router, tmp_path):
    browser = find_browser()
    if browser is None:
        pytest.skip(NO_BROWSER)
    await _shared_prefix_traffic(router, 6)
    page = router.url + "/dashboard"
    dom = await chromium(browser, "--dump-dom", page)
    assert 'data-rendered="yes"' in dom, dom[-3000:]
    for worker in router.state.fleet.alive("tiny"):
        assert worker.worker_id in dom
    assert dom.count('<td class="role">both</td>') == len(router.state.fleet.alive("tiny"))
    assert '<section id="by-role" hidden="">' in dom  # an aggregated fleet: no table by role
    labels = re.findall(r'<text[^>]*class="y-label"[^>]*>([^<]*)</text>', dom)
    assert labels == ["0%", "25%", "50%", "75%", "100%"], labels  # the chart's y axis says what it shows
    # the hit rate is drawn wide under the thin dashed prediction: equal, both stay visible
    hit, predicted = (
        re.search(rf'<polyline[^>]*class="line-{f}"[^>]*>', dom) for f in ("hit_rate", "predicted_hit_rate")
    )
    assert hit and predicted and hit.start() < predicted.start(), dom[-3000:]
    assert 'stroke-width="4"' in hit.group() and 'stroke-dasharray="5 3"' in predicted.group()
    hit_rate = re.search(r'id="hit-rate"[^>]*>([^<]*)<', dom)
    assert hit_rate and re.fullmatch(r"\d{1,3}\.\d%", hit_rate.group(1)), hit_rate
    regret = re.search(r'id="regret"[^>]*>([^<]*)<', dom)  # every request went to the owner: none regretted
    assert regret and regret.group(1) == "0.0%", regret
    shot = tmp_path / "dashboard.png"
    await chromium(browser, "--hide-scrollbars", "--window-size=1280,1000", f"--screenshot={shot}", page)
    assert shot.stat().st_size > 10_000
    if target := os.environ.get("KVROUTE_DASHBOARD_SCREENSHOT"):
        shutil.copyfile(shot, Path(target))
