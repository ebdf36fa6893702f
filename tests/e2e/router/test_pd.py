"""Prefill/decode fleets through routers (router/routing/pd.py, router/upstream/split.py): simulated
engines with a KV connector (--kv-transfer), two prefill and two decode workers (their agents'
--role), two router replicas. A split request is prefilled on a prefill worker, its KV pulled by a
decode worker that streams the reply; a whole request lands on a prefill worker that holds its
prefix (the default) or, with --pd-whole-on decode, never on a prefill worker; a leg's worker that
is gone is replaced; the client's fields reach both legs."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator

import aiohttp
import pytest

from router.main import RunningRouter
from router.routing.pd import PdCosts, SplitMode, WholeOn
from tests.support import SimFleet, wait_for_workers, wait_until
from tests.support.browser import NO_BROWSER, chromium, find_browser
from tests.support.cluster import index_credits
from tests.support.router import PREFIX, start_router

ROLES = ["prefill", "prefill", "decode", "decode"]


@pytest.fixture
async def pd_fleet(redis_server) -> AsyncIterator[SimFleet]:
    fleet = await SimFleet(redis_server.url, count=len(ROLES), roles=ROLES).start()
    yield fleet
    await fleet.stop()


async def routers(
    fleet: SimFleet, redis_url: str, mode: SplitMode, count: int = 2, whole_on: WholeOn = WholeOn.ANY
) -> list[tuple[object, RunningRouter]]:
    started = []
    for _ in range(count):
        context, running = await start_router(redis_url, pd=PdCosts(mode, whole_on=whole_on))
        await wait_for_workers(running, fleet.count)
        started.append((context, running))
    return started


async def stop(started: list[tuple[object, RunningRouter]]) -> None:
    for context, _ in started:
        await context.__aexit__(None, None, None)  # type: ignore[attr-defined]


async def post(url: str, body: dict) -> tuple[int, dict, list[dict] | dict]:
    """The reply: status, headers, and the JSON (a stream: its events' JSON, [DONE] left out)."""
    async with aiohttp.ClientSession() as session, session.post(url + "/v1/completions", json=body) as response:
        raw = await response.read()
        headers = dict(response.headers)
    if headers.get("Content-Type", "").startswith("text/event-stream"):
        events = [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: {")]
        return response.status, headers, [json.loads(e) for e in events]
    return response.status, headers, json.loads(raw)


def ids(fleet: SimFleet, role: str) -> set[str]:
    return {fleet.worker_id(i) for i, r in enumerate(ROLES) if r == role}


async def test_a_split_request_is_prefilled_on_one_worker_and_decoded_on_another(pd_fleet, redis_server):
    started = await routers(pd_fleet, redis_server.url, SplitMode.ALWAYS)
    (_, first), (_, second) = started
    try:
        body = {"model": "tiny", "prompt": [*PREFIX, 1], "max_tokens": 5, "temperature": 0.5}
        status, headers, reply = await post(first.url, body)
        assert status == 200, reply
        prefill, decoder = headers["x-kvroute-prefill-worker"], headers["x-kvroute-worker"]
        assert prefill in ids(pd_fleet, "prefill") and decoder in ids(pd_fleet, "decode")
        assert reply["usage"]["completion_tokens"] == 5  # the client's max_tokens reached the decode leg
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == int(headers["x-kvroute-cached-tokens"]) == 0

        async def prefill_indexed() -> bool:  # the other replica sees the prefill worker's prefix
            async with aiohttp.ClientSession() as session:
                credits = await index_credits(session, second.url, "tiny", [*PREFIX, 2])
            return credits.get(prefill) == len(PREFIX) // 16

        await wait_until(prefill_indexed, 10)
        streamed = {**body, "prompt": [*PREFIX, 2], "stream": True, "stream_options": {"include_usage": True}}
        status, headers, events = await post(second.url, streamed)
        assert status == 200 and headers["x-kvroute-prefill-worker"] == prefill  # its cache
        usage = next(e["usage"] for e in events if e.get("usage"))
        assert usage["completion_tokens"] == 5 and any(e.get("choices") for e in events)
        # predicted == reported on the prefill side, which the client's usage says
        assert usage["prompt_tokens_details"]["cached_tokens"] == int(headers["x-kvroute-cached-tokens"]) == 160
        metrics = await _text(second.url + "/metrics")
        assert 'kvroute_router_split_requests_total{model="tiny"} 1.0' in metrics
    finally:
        await stop(started)


async def test_a_prompt_the_workers_hold_is_served_whole_on_a_prefill_worker_too(pd_fleet, redis_server):
    """The default (--pd-whole-on any): a prefill worker is a complete engine. Split, a request is
    prefilled where its prefix is held anyway and pays the transfer and the hop on top, so a prompt
    held by the workers is served whole, and cold prompts on an idle fleet too, on either role."""
    (splitting,) = await routers(pd_fleet, redis_server.url, SplitMode.ALWAYS, count=1)
    (deciding,) = await routers(pd_fleet, redis_server.url, SplitMode.AUTO, count=1)
    try:
        body = {"model": "tiny", "prompt": [*PREFIX, 1], "max_tokens": 2}
        status, headers, reply = await post(splitting[1].url, body)
        assert status == 200, reply
        holders = {headers["x-kvroute-prefill-worker"], headers["x-kvroute-worker"]}  # the decoder pulled it

        async def indexed() -> bool:
            async with aiohttp.ClientSession() as session:
                credits = await index_credits(session, deciding[1].url, "tiny", [*PREFIX, 2])
            return all(credits.get(worker) == len(PREFIX) // 16 for worker in holders)

        await wait_until(indexed, 10)
        status, headers, reply = await post(deciding[1].url, {**body, "prompt": [*PREFIX, 2], "max_tokens": 3})
        assert status == 200 and headers["x-kvroute-worker"] in holders, reply
        assert "x-kvroute-prefill-worker" not in headers  # whole: not split
        usage = reply["usage"]
        assert usage["completion_tokens"] == 3 and usage["prompt_tokens_details"]["cached_tokens"] == 160
        # cold prompts on an idle fleet: every worker as cheap, each served whole where the tie falls,
        # prefill workers included (all 16 on decode workers: one chance in 65,536)
        served = set()
        for n in range(16):
            status, headers, reply = await post(deciding[1].url, {**body, "prompt": [100 + n] * 40})
            assert status == 200 and "x-kvroute-prefill-worker" not in headers, reply
            served.add(headers["x-kvroute-worker"])
        assert served & ids(pd_fleet, "prefill")
    finally:
        await stop([splitting, deciding])


async def test_with_whole_on_decode_whole_requests_never_reach_a_prefill_worker(pd_fleet, redis_server):
    """Idle decode workers: a request is cheaper whole (no decode there to delay), so auto serves
    it whole; and never on a prefill worker."""
    started = await routers(pd_fleet, redis_server.url, SplitMode.AUTO, count=1, whole_on=WholeOn.DECODE)
    (_, router) = started[0]
    try:
        for tail in range(6):
            status, headers, reply = await post(
                router.url, {"model": "tiny", "prompt": [*PREFIX, tail], "max_tokens": 2}
            )
            assert status == 200, reply
            assert "x-kvroute-prefill-worker" not in headers and headers["x-kvroute-worker"] in ids(pd_fleet, "decode")
        async with aiohttp.ClientSession() as session, session.get(router.url + "/dashboard/api/fleet") as response:
            (model,) = (await response.json())["models"]
        assert sorted(w["role"] for w in model["workers"]) == ["decode", "decode", "prefill", "prefill"]
    finally:
        await stop(started)


@pytest.mark.parametrize(
    ("role", "header"),
    [
        ("prefill", "x-kvroute-prefill-worker"),
        # it refuses the connection: it never pulled the KV, which the prefill worker still holds
        # for the next decode worker
        ("decode", "x-kvroute-worker"),
    ],
)
async def test_a_legs_engine_gone_is_replaced_and_no_request_is_lost(pd_fleet, redis_server, role, header):
    started = await routers(pd_fleet, redis_server.url, SplitMode.ALWAYS)
    try:
        _, router = started[0]
        _, headers, _ = await post(router.url, {"model": "tiny", "prompt": [*PREFIX, 39], "max_tokens": 2})
        gone = headers[header]  # it holds the prefix now: every replica's first choice among its role's
        await wait_indexed_everywhere(started, gone)
        # its engine goes; its agent stays up a while, so the index still lists it
        await pd_fleet.kill_engine(next(i for i in range(len(ROLES)) if pd_fleet.worker_id(i) == gone))
        (other,) = ids(pd_fleet, role) - {gone}
        for n in range(6):
            _, router = started[n % 2]
            body = {"model": "tiny", "prompt": [*PREFIX, 40 + n], "max_tokens": 3}
            status, headers, reply = await post(router.url, body)
            assert status == 200, reply
            assert headers[header] == other and reply["usage"]["completion_tokens"] == 3
        # the gone worker was tried first (by the replica that decided next; the other may have seen
        # the prefix elsewhere by then, or the worker deregistered), and replaced
        assert sum([await upstream_errors(r, gone) for _, r in started]) >= 1
    finally:
        await stop(started)


async def wait_indexed_everywhere(started: list[tuple[object, RunningRouter]], worker: str) -> None:
    """Until every replica's index lookup credits ``worker`` with the shared prefix."""

    async def credited() -> bool:
        async with aiohttp.ClientSession() as session:
            credits = [await index_credits(session, r.url, "tiny", [*PREFIX, 0]) for _, r in started]
        return all(c.get(worker) == len(PREFIX) // 16 for c in credits)

    await wait_until(credited, 10)


async def upstream_errors(router: RunningRouter, worker: str) -> float:
    found = re.search(
        rf'kvroute_router_upstream_errors_total{{worker="{re.escape(worker)}"}} ([0-9.]+)',
        await _text(router.url + "/metrics"),
    )
    return float(found.group(1)) if found else 0.0


async def _text(url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return await response.text()


async def test_the_dashboard_shows_the_accounting_by_role(pd_fleet, redis_server):
    """Split requests are charged to their prefill worker's role: the JSON says so, and a real
    browser renders the table by role (hidden for an aggregated fleet: tests/e2e/router/test_dashboard.py)."""
    (started,) = await routers(pd_fleet, redis_server.url, SplitMode.ALWAYS, count=1)
    router = started[1]
    try:
        for tail in range(3):
            status, _, reply = await post(router.url, {"model": "tiny", "prompt": [*PREFIX, tail], "max_tokens": 2})
            assert status == 200, reply
        async with (
            aiohttp.ClientSession() as session,
            session.get(router.url + "/dashboard/api/accounting") as response,
        ):
            by_role = (await response.json())["by_role"]
        assert list(by_role) == ["prefill"] and by_role["prefill"]["accounted"] == 3
        browser = find_browser()
        if browser is None:
            pytest.skip(NO_BROWSER)
        dom = await chromium(browser, "--dump-dom", router.url + "/dashboard")
        assert 'data-rendered="yes"' in dom and '<section id="by-role">' in dom, dom[-3000:]
        row = re.search(
            r'<tr data-role="prefill"><td>prefill</td><td class="num">(\d+)</td><td class="num hit">([^<]*)<', dom
        )
        assert row and row.group(1) == "3" and re.fullmatch(r"\d{1,3}\.\d%", row.group(2)), dom[-3000:]
    finally:
        await stop([started])
