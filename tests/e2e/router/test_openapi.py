"""GET /openapi.json describes every route the router serves, and a real router process fuzzed
from that document (schemathesis: bodies that fit it and bodies that break it, over real HTTP to
real simulated engines) answers no 5xx."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import aiohttp
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from kvroute.devstack.embedded_redis import free_port
from router.app import create_routes
from tests.support import ROOT, wait_until

EXAMPLES = 400  # ~20-40 s here; every operation, positive and negative


async def _document(url: str) -> dict:
    async with aiohttp.ClientSession() as session, session.get(url + "/openapi.json") as response:
        assert response.status == 200 and response.content_type == "application/json"
        return await response.json()


async def test_the_document_describes_every_route_the_app_serves(router):
    document = await _document(router.url)
    assert document["openapi"].startswith("3.")
    described = {(method.upper(), path) for path, item in document["paths"].items() for method in item}
    served = {(route.method, route.path) for route in create_routes(router.state)}
    assert described == served
    schemathesis.openapi.from_dict(document).validate()  # a valid OpenAPI 3 document


def _fuzz(url: str, document: dict) -> list[str]:
    """Send EXAMPLES generated requests; the server errors seen, one line each."""
    schema = schemathesis.openapi.from_dict(document)
    cases = st.one_of(
        schema.as_strategy(generation_mode=GenerationMode.POSITIVE),
        schema.as_strategy(generation_mode=GenerationMode.NEGATIVE),
    )
    failures: list[str] = []
    http = requests.Session()

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=cases, served_model=st.booleans())
    def send(case, served_model: bool) -> None:
        if served_model and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = "tiny"  # reach the decision and the engines, not only the 404
            for name in ("max_tokens", "max_completion_tokens"):
                # A valid length can mean minutes of simulated generation (up to the context, for
                # each of a batch's prompts): the fuzz looks for server errors, not for speed.
                if isinstance(case.body.get(name), int) and case.body[name] > 16:
                    case.body[name] = 16
        response = case.call(base_url=url, session=http, timeout=30)
        if response.status_code >= 500:
            failures.append(
                f"{case.method} {case.path} {str(case.body)[:200]} -> {response.status_code} {response.text[:200]}"
            )

    send()
    return failures


@pytest.mark.slow
async def test_fuzzed_requests_from_the_document_get_no_server_error(fleet, redis_server):
    port = free_port()
    command = [sys.executable, "-m", "router", "--redis-url", redis_server.url, "--port", str(port)]
    process = subprocess.Popen([*command, "--log-level", "WARNING"], cwd=ROOT)  # noqa: ASYNC220
    url = f"http://127.0.0.1:{port}"
    try:

        async def ready() -> bool:
            try:
                async with aiohttp.ClientSession() as session, session.get(url + "/ready") as response:
                    return response.status == 200 and len((await response.json())["models"]) == 1
            except aiohttp.ClientError:
                return False

        await wait_until(ready, 30)
        document = await _document(url)
        # In a thread: the simulated engines answer from this event loop meanwhile.
        failures = await asyncio.to_thread(_fuzz, url, document)
        assert failures == [], "\n".join(failures[:10])
        assert process.poll() is None  # still serving
    finally:
        process.terminate()
        await asyncio.to_thread(process.wait, 30)
