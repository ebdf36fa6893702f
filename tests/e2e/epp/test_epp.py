"""kvroute as the Gateway API Inference Extension's endpoint picker, driven over ext_proc by a
client that plays Envoy (tests/support/envoy.py), against simulated engines and agent processes."""

from __future__ import annotations

import json

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.epp.server import RunningEpp
from router.epp.wire import endpoint_of
from tests.support import SimFleet, wait_for_workers, wait_until
from tests.support.envoy import EnvoyStream, relay
from tests.support.router import PREFIX, start_router, wait_indexed

COMPLETIONS = "/v1/completions"


def _body(prompt: list[int], **extra: object) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 2, **extra}


def _worker_of(epp: RunningEpp, endpoint: str) -> str:
    return next(w.worker_id for w in epp.router.state.fleet.alive("tiny") if endpoint_of(w.url) == endpoint)


def _booked(epp: RunningEpp) -> dict:
    return epp.router.state.load.inflight("tiny")


async def _released(epp: RunningEpp) -> None:
    """Until nothing is booked any more (a stream's end reaches the picker a moment later)."""

    async def none_booked() -> bool:
        return _booked(epp) == {}

    await wait_until(none_booked, 5)


async def _debug_route(url: str, body: dict) -> str:
    async with aiohttp.ClientSession() as session, session.post(url + "/debug/route", json=body) as reply:
        return (await reply.json())["chosen"]


@pytest.mark.parametrize("mode", ["buffered", "duplex"])
async def test_a_pick_names_the_worker_holding_the_prefix_and_the_reply_closes_its_booking(epp, channel, mode):
    async with aiohttp.ClientSession() as session:
        async with EnvoyStream(channel, mode) as stream:
            body = _body([*PREFIX, 1])
            pick = await stream.request(COMPLETIONS, body, chunk_size=100)
            assert pick.status is None and pick.endpoints and pick.endpoints == pick.metadata
            assert len(pick.endpoints) == 3  # the chosen worker and two fallbacks, best first
            if mode == "duplex":
                assert json.loads(pick.body_back) == body  # the body passed on unchanged
            owner = _worker_of(epp, pick.endpoints[0])
            assert set(_booked(epp)) == {owner}  # booked while the reply is due
            await relay(stream, session, pick.endpoints[0], COMPLETIONS, body)
        await _released(epp)
        assert await wait_indexed(epp.router, PREFIX) == owner
        for tail in range(2, 5):
            async with EnvoyStream(channel, mode) as stream:
                pick = await stream.request(COMPLETIONS, _body([*PREFIX, tail]))
                assert _worker_of(epp, pick.endpoints[0]) == owner
                reply = json.loads(await relay(stream, session, pick.endpoints[0], COMPLETIONS, _body([*PREFIX, tail])))
                assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 160
    metrics = epp.router.state.metrics
    assert metrics.predicted_cached_tokens.labels("tiny")._value.get() >= 480  # the replies' usage was read


async def test_picks_equal_the_http_routers_decisions(epp, channel, fleet: SimFleet, redis_server):
    """Request by request, the picker's choice is the HTTP router's decision for the same prompt
    (/debug/route: the decision without sending it) on the same replica's state; and another
    replica sharing the Redis sends a prompt whose prefix one worker holds where the picker does
    (replicas differ where they learned differently: ties among equally good workers)."""
    context, router = await start_router(redis_server.url)
    try:
        await wait_for_workers(router, fleet.count)
        async with aiohttp.ClientSession() as session:
            async with EnvoyStream(channel) as stream:
                pick = await stream.request(COMPLETIONS, _body([*PREFIX, 1]))
                await relay(stream, session, pick.endpoints[0], COMPLETIONS, _body([*PREFIX, 1]))
            await wait_indexed(router, PREFIX)
            prompts = [[*PREFIX, 9], [*PREFIX[:32], 7, 7], [(i * 7) % 1900 + 3 for i in range(200)], [5, 6, 7]]
            for prompt in prompts:
                await _released(epp)
                expected = await _debug_route(epp.router.url, _body(prompt))
                elsewhere = await _debug_route(router.url, _body(prompt))
                async with EnvoyStream(channel) as stream:
                    pick = await stream.request(COMPLETIONS, _body(prompt))
                    picked = _worker_of(epp, pick.endpoints[0])
                    assert picked == expected, prompt
                    assert picked == elsewhere or prompt[:16] != PREFIX[:16], prompt
                    await relay(stream, session, pick.endpoints[0], COMPLETIONS, _body(prompt))
    finally:
        await context.__aexit__(None, None, None)  # type: ignore[attr-defined]


async def test_a_header_only_pick_uses_the_model_header(epp, channel):
    async with EnvoyStream(channel, "headers") as stream:
        pick = await stream.request(COMPLETIONS, None, headers={"x-gateway-model-name": "tiny"})
        assert pick.status is None and len(pick.endpoints) == 3
        assert len(_booked(epp)) == 1
    await _released(epp)


async def test_mistakes_are_immediate_replies_in_openais_shape(epp, channel):
    async with EnvoyStream(channel) as stream:
        pick = await stream.request(COMPLETIONS, _body([1, 2, 3]) | {"model": "nope"})
    assert pick.status == 404 and "nope" in pick.error["error"]["message"]
    async with EnvoyStream(channel) as stream:
        pick = await stream.request(COMPLETIONS, b'{"model": "tiny", "prompt": [1, 2')
    assert pick.status == 400 and pick.error["error"]["type"] == "invalid_request_error"
    async with EnvoyStream(channel, "duplex") as stream:
        pick = await stream.request(COMPLETIONS, _body([1, 2, 3], max_tokens="many"))
    assert pick.status == 400 and pick.error["error"]["param"] == "max_tokens"
    assert _booked(epp) == {}


async def test_a_client_that_goes_away_releases_the_booking(epp, channel):
    stream = EnvoyStream(channel)
    async with stream:
        pick = await stream.request(COMPLETIONS, _body([*PREFIX, 3]))
        assert pick.endpoints and _booked(epp)
        stream.cancel()
    await _released(epp)


async def test_the_subset_hint_limits_the_pick(epp, channel):
    endpoints = sorted(endpoint_of(w.url) for w in epp.router.state.fleet.alive("tiny"))
    async with EnvoyStream(channel) as stream:
        pick = await stream.request(COMPLETIONS, _body([4, 5, 6]), subset=[endpoints[1]])
        assert pick.endpoints == [endpoints[1]]
    async with EnvoyStream(channel) as stream:
        pick = await stream.request(COMPLETIONS, _body([4, 5, 6]), subset=["10.9.9.9:80"])
    assert pick.status == 503


async def test_a_fallback_that_served_takes_the_booking(epp, channel):
    async with aiohttp.ClientSession() as session, EnvoyStream(channel) as stream:
        pick = await stream.request(COMPLETIONS, _body([7, 8, 9] * 40))
        first, second = pick.endpoints[0], pick.endpoints[1]
        async with session.post(f"http://{second}{COMPLETIONS}", json=_body([7, 8, 9] * 40)) as response:
            chunks = [chunk async for chunk in response.content.iter_any()]
            await stream.reply_headers(response.status, served=second)
            assert set(_booked(epp)) == {_worker_of(epp, second)} != {_worker_of(epp, first)}
            await stream.reply_body(chunks)
    await _released(epp)


async def test_grpc_health_serves_liveness_and_readiness(epp, channel):
    stub = health_pb2_grpc.HealthStub(channel)
    for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
    with pytest.raises(grpc.aio.AioRpcError):
        await stub.Check(health_pb2.HealthCheckRequest(service="nothing"))
