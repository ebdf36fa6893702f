"""The router's answers to hostile input (real router, real HTTP, simulated engines): nesting
deep enough to exhaust a recursive decoder is a one-line 400, never a 500 with a traceback; paths
and methods no route serves are 404/405 counted under one fixed label."""

from __future__ import annotations

import logging

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.router import complete

ROUTES = {"/v1/completions", "/v1/chat/completions", "/debug/route", "/v1/models", "/health", "/ready", "/metrics"}


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/debug/route"])
async def test_deeply_nested_json_is_a_one_line_400_and_the_router_keeps_serving(router, path, caplog):
    caplog.set_level(logging.DEBUG)
    bodies = {
        "a bare array": _nested(100_000),
        "an object": '{"model": "tiny", "prompt": ' + _nested(100_000) + "}",
        "a deep message field": '{"model": "tiny", "messages": [{"role": "user", "content": "hi", "x": '
        + _nested(950)
        + "}]}",
        "a deep prompt": '{"model": "tiny", "prompt": ' + _nested(950) + "}",
    }
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession() as session:
        for what, body in bodies.items():
            async with session.post(router.url + path, data=body.encode(), headers=headers) as response:
                reply = await response.json(content_type=None)
            assert 400 <= response.status < 500, (what, response.status, reply)
            assert "\n" not in reply["error"]["message"] and reply["error"]["code"] == response.status
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]
    status, _, reply = await complete(router.url, "still serving")
    assert status == 200, reply


async def test_the_nesting_message_names_the_problem(router):
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            router.url + "/v1/completions", data=b'{"prompt": ' + _nested(100_000).encode() + b"}"
        ) as response,
    ):
        reply = await response.json()
    assert response.status == 400 and reply["error"]["message"] == "the request body is nested too deeply"


async def test_unknown_paths_and_methods_are_counted_under_one_label(router):
    probes = [("GET", f"/scan/{i}/admin.php") for i in range(20)]
    probes += [("POST", "/v1/completions/extra"), ("DELETE", "/v1/models"), ("PATCH", "/health")]
    probes += [("GET", "/v1/../etc/passwd"), ("HEAD", "/nothing"), ("OPTIONS", "/metrics")]
    async with aiohttp.ClientSession() as session:
        for method, path in probes:
            async with session.request(method, router.url + path) as response:
                assert response.status in (404, 405), (method, path, response.status)
                if method != "HEAD":
                    assert (await response.json())["error"]["code"] == response.status
        async with session.get(router.url + "/metrics") as response:
            text = await response.text()
    endpoints = {
        sample.labels["endpoint"]
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "kvroute_router_requests_total"
    }
    assert endpoints <= ROUTES | {"unmatched"} and "unmatched" in endpoints, endpoints
    assert "admin.php" not in text and "passwd" not in text
