"""The endpoint picker when things go wrong, and with a second replica: an engine that dies while
its reply is due, a picker that stops with streams open and another that takes over, two pickers
taking requests in turn over one shared in-flight load."""

from __future__ import annotations

import aiohttp
import grpc
import pytest

from kvindex.hashing import sequence_hashes
from kvroute.devstack.embedded_redis import RedisServer
from router.epp.server import RunningEpp, running_epp
from router.epp.wire import endpoint_of
from tests.e2e.epp.conftest import epp_settings
from tests.support import SimFleet, wait_for_workers, wait_until
from tests.support.envoy import EnvoyStream, relay

COMPLETIONS = "/v1/completions"
PROMPT = [(i * 11) % 1900 + 7 for i in range(320)]


def _body(prompt: list[int]) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 2}


async def _until_booked(epp: RunningEpp, expected: set[str], others: bool = False) -> None:
    """Until ``epp`` sees load on exactly ``expected`` workers: its own booking, or (``others``)
    what the other replicas booked, as its next lookup reads it from Redis."""

    async def seen() -> bool:
        if others:
            view = await epp.router.state.index.lookup("tiny", sequence_hashes(PROMPT, 16))
            return set(view.totals) == expected
        return set(epp.router.state.load.inflight("tiny")) == expected

    await wait_until(seen, 10)


def _worker_of(epp: RunningEpp, endpoint: str) -> str:
    return next(w.worker_id for w in epp.router.state.fleet.alive("tiny") if endpoint_of(w.url) == endpoint)


async def test_an_engine_that_dies_with_the_reply_due_releases_the_booking(epp, channel, fleet: SimFleet):
    async with EnvoyStream(channel) as stream:
        pick = await stream.request(COMPLETIONS, _body(PROMPT))
        worker = _worker_of(epp, pick.endpoints[0])
        await _until_booked(epp, {worker})
        await fleet.kill_engine(next(i for i in range(fleet.count) if fleet.worker_id(i) == worker))
        async with aiohttp.ClientSession() as session:
            with pytest.raises(aiohttp.ClientError):
                await relay(stream, session, pick.endpoints[0], COMPLETIONS, _body(PROMPT))
        await stream.reply(503, [b"upstream connect error"])  # Envoy's own reply to the client
    await _until_booked(epp, set())


async def test_a_stopped_picker_ends_its_streams_and_another_takes_over(fleet: SimFleet, redis_server: RedisServer):
    async with running_epp(epp_settings(redis_server.url)) as second:
        await wait_for_workers(second.router, fleet.count)
        await second.router.state.load.renew_all(["tiny"])
        async with running_epp(epp_settings(redis_server.url)) as first:
            await wait_for_workers(first.router, fleet.count)
            async with grpc.aio.insecure_channel(first.grpc_target) as channel:
                stream = EnvoyStream(channel)
                await stream.__aenter__()
                pick = await stream.request(COMPLETIONS, _body(PROMPT))
                worker = _worker_of(first, pick.endpoints[0])
                await first.router.state.load.renew_all(["tiny"])
                await second.router.state.load.renew_all(["tiny"])  # each knows the other is live
                await _until_booked(second, {worker}, others=True)
        # The first stopped with its stream open: the stream ended, and its load stops counting.
        assert await stream.status() != grpc.StatusCode.OK
        await _until_booked(second, set(), others=True)
        async with grpc.aio.insecure_channel(second.grpc_target) as channel, EnvoyStream(channel) as again:
            pick = await again.request(COMPLETIONS, _body(PROMPT))
            assert pick.status is None and pick.endpoints


async def test_two_pickers_in_turn_share_one_in_flight_load(epp, channel, fleet: SimFleet, redis_server: RedisServer):
    """Requests held open on one picker are load the other sees; released, it is gone for both."""
    async with running_epp(epp_settings(redis_server.url)) as other:
        await wait_for_workers(other.router, fleet.count)
        for replica in (epp, other, epp):
            await replica.router.state.load.renew_all(["tiny"])
        async with grpc.aio.insecure_channel(other.grpc_target) as other_channel:
            streams = [EnvoyStream(channel), EnvoyStream(other_channel)]
            picks = []
            for i, stream in enumerate(streams):  # in turn: one on each picker
                await stream.__aenter__()
                picks.append(await stream.request(COMPLETIONS, _body([*PROMPT, i])))
            first = _worker_of(epp, picks[0].endpoints[0])
            second = _worker_of(other, picks[1].endpoints[0])
            await _until_booked(other, {first}, others=True)
            await _until_booked(epp, {second}, others=True)
            async with aiohttp.ClientSession() as session:
                for stream, pick, i in zip(streams, picks, range(2), strict=True):
                    await relay(stream, session, pick.endpoints[0], COMPLETIONS, _body([*PROMPT, i]))
                    await stream.__aexit__(None, None, None)
            await _until_booked(other, set(), others=True)
            await _until_booked(epp, set(), others=True)
