"""Prefill/decode disaggregation between simulated engines (sim_engine/kv_transfer.py,
decode_legs.py), as vLLM 0.32 runs it with its NIXL connector: two ``SimEngine`` objects driven
step by step through ``schedule`` / ``complete``, the pull between their connectors in-process
(the HTTP endpoints with the engines' apps at the end)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest

from kvevents.vllm import BlockStored, Event
from sim_engine import api
from sim_engine.engine import RequestRejected, SimEngine, SimRequest, StepPlan, TimingModel
from sim_engine.kv_transfer import KVConnector, TransferError
from sim_engine.kv_transfer_api import new_request, remote_prefill
from sim_engine.main import build_parser
from sim_engine.server import RunningEngine, running_engine
from sim_engine.settings import SimEngineSettings, settings_from_args
from sim_engine.types import FAILED, PULLED, PULLING, UNREAD, RemotePrefill
from tests.support import wait_until

BS = 4
BLOCKS = 32
PROMPT = list(range(100, 113))  # 3 full blocks and one token more
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None}


def engine(ms_per_1k: float = 0.0, timeout_s: float = 30.0, seqs: int = 8) -> SimEngine:
    connector = KVConnector(ms_per_1k_tokens=ms_per_1k, timeout_s=timeout_s)
    connector.port = 8000  # what its replies name (the pulls here do not go over HTTP)
    return SimEngine(BLOCKS, BS, TimingModel(speedup=1000.0, max_num_seqs=seqs), connector=connector)


def link(decode: SimEngine, prefill: SimEngine) -> None:
    """The decode engine reads from the prefill engine's connector directly (no HTTP)."""
    assert decode.connector is not None and prefill.connector is not None
    source = prefill.connector

    async def transport(remote: RemotePrefill, block_ids: list[int], read_s: float) -> list[int]:
        return await source.serve_pull(remote.engine_id, remote.request_id, block_ids, read_s)

    decode.connector.transport = transport


def step(sim: SimEngine) -> tuple[StepPlan, list[Event]]:
    plan = sim.schedule()
    events = sim.pool.take_events()
    sim.complete(plan)
    return plan, events


def serve(sim: SimEngine, request: SimRequest) -> list[Event]:
    """Run a request that pulls nothing to its end: the events of its steps."""
    sim.submit(request)
    events: list[Event] = []
    while not request.finished.is_set():
        events += step(sim)[1]
    return events


def prefill_leg(sim: SimEngine, prompt: list[int] = PROMPT, name: str = "p") -> SimRequest:
    request = SimRequest(name, prompt, max_tokens=1, remote_decode=True)
    serve(sim, request)
    return request


def decode_leg(prefilled: SimRequest, prompt: list[int] = PROMPT, name: str = "d", max_tokens: int = 3) -> SimRequest:
    assert prefilled.kv_transfer_out is not None
    return SimRequest(name, prompt, max_tokens, remote=remote_prefill(prefilled.kv_transfer_out))


async def pulled(request: SimRequest) -> None:
    assert request.remote is not None
    remote = request.remote

    async def over() -> bool:
        return remote.state not in (UNREAD, PULLING)

    await wait_until(over, within=5)


def free(sim: SimEngine) -> int:
    return sim.pool.num_free


async def test_a_prefill_leg_keeps_its_blocks_and_names_them_as_vllm_does():
    prefill = engine()
    request = prefill_leg(prefill)
    params = request.kv_transfer_out
    assert params is not None and prefill.connector is not None
    assert list(params) == [  # NIXL's request_finished, in its order, then the prefill's cached tokens
        "do_remote_prefill",
        "do_remote_decode",
        "remote_block_ids",
        "remote_engine_id",
        "remote_request_id",
        "remote_host",
        "remote_port",
        "tp_size",
        "dcp_size",
        "pp_size",
        "remote_num_tokens",
        "remote_blocks_expiry_time",
        "transfer_mode",
        "remote_prefill_cached_tokens",
    ]
    held = prefill.connector.held["p"].blocks
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_block_ids"] == [[b.block_id for b in held]] and len(held) == 4
    assert (params["remote_engine_id"], params["remote_request_id"]) == (prefill.connector.engine_id, "p")
    assert (params["remote_num_tokens"], params["remote_prefill_cached_tokens"], params["transfer_mode"]) == (
        13,
        0,
        "pull",
    )
    assert free(prefill) == BLOCKS - 1 - 4 and prefill.pool.usage > 0  # used, not evictable
    assert all(b.ref_cnt == 1 for b in held) and not request.blocks
    assert prefill.cached_prefix_tokens(PROMPT) == 12  # its full blocks are in the prefix cache
    again = prefill_leg(prefill, name="p2")
    assert again.kv_transfer_out is not None and again.kv_transfer_out["remote_prefill_cached_tokens"] == 12
    plain = SimRequest("plain", list(range(500, 509)), max_tokens=1)
    serve(prefill, plain)  # a request without parameters frees its blocks as ever
    assert plain.kv_transfer_out is None and "plain" not in prefill.connector.held
    longer = SimRequest("two", list(range(600, 609)), max_tokens=2, remote_decode=True)
    serve(prefill, longer)  # vLLM gives the prefill's cached tokens with its first output only
    assert longer.kv_transfer_out is not None and "remote_prefill_cached_tokens" not in longer.kv_transfer_out
    assert longer.kv_transfer_out["remote_num_tokens"] == 10  # the prompt and the first output token


async def test_a_decode_leg_takes_its_local_hit_pulls_the_rest_and_computes_the_last_token():
    prefill, decode = engine(), engine()
    link(decode, prefill)
    prefilled = prefill_leg(prefill)
    serve(decode, SimRequest("warm", [*PROMPT[:4], 7, 7, 7], max_tokens=1))  # the decode engine holds block 0
    before = free(decode)
    leg = decode.submit(decode_leg(prefilled))
    plan, events = step(decode)
    assert leg in decode.loading and not decode.running and decode.num_waiting == 1  # vLLM: waiting for KV
    assert plan.tokens_of(leg) == 0 and not events  # nothing computed, nothing cached yet
    assert len(leg.blocks) == 4 and free(decode) == before - 4  # its whole prompt's: the hit (was free) + 3 new
    await pulled(leg)
    assert leg.remote is not None and leg.remote.state == PULLED
    assert free(prefill) == BLOCKS - 1 and not prefill.connector.held  # read: the prefill engine freed them
    assert prefill.cached_prefix_tokens(PROMPT) == 12  # ... and keeps them cached, evictable
    plan, events = step(decode)
    assert plan.scheduled == [(leg, 1)] and plan.prefill_tokens == 1  # the last prompt token, for its logits
    (stored,) = events  # the pulled full blocks join this engine's prefix cache, announced from here
    assert isinstance(stored, BlockStored) and list(stored.token_ids) == PROMPT[4:12]
    assert stored.parent_block_hash == leg.hashes[0] and list(stored.block_hashes) == leg.hashes[1:3]
    assert len(leg.output) == 1 and leg.num_computed == 13 and leg.scheduled_at is not None
    assert (leg.cached_tokens, leg.external_tokens, leg.reported_cached_tokens) == (13, 9, 0)
    stats = decode.stats
    assert (stats.prompt_tokens_cached, stats.prompt_tokens_external, stats.prefix_hits) == (13, 9, 4)
    while not leg.finished.is_set():
        step(decode)
    assert len(leg.output) == 3 and decode.cached_prefix_tokens(PROMPT) == 12


async def test_the_reply_reports_the_prefill_engines_hit_or_else_everything_loaded():
    prefill, decode = engine(), engine()
    link(decode, prefill)
    prefill_leg(prefill, name="first")
    prefilled = prefill_leg(prefill, name="second")  # hits 12 tokens there
    leg = decode.submit(decode_leg(prefilled))
    step(decode)
    await pulled(leg)
    step(decode)
    assert leg.reported_cached_tokens == 12 and leg.cached_tokens == 13
    assert prefilled.kv_transfer_out is not None
    params = {k: v for k, v in prefilled.kv_transfer_out.items() if k != "remote_prefill_cached_tokens"}
    assert SimRequest("x", PROMPT, 1, remote=remote_prefill(params)).reported_cached_tokens == 0  # not counted yet


async def test_the_pull_lasts_its_transfer_time_while_other_requests_run():
    prefill, decode = engine(), engine(ms_per_1k=4000.0)  # 13 tokens: 52 ms
    link(decode, prefill)
    leg = decode.submit(decode_leg(prefill_leg(prefill)))
    other = decode.submit(SimRequest("other", list(range(300, 306)), max_tokens=1))
    started = time.monotonic()
    plan, _ = step(decode)
    assert plan.tokens_of(other) == 6 and other.finished.is_set()  # served while the leg waits
    assert leg.remote is not None and leg.remote.state == PULLING
    assert prefill.connector is not None
    held = prefill.connector.held["p"]

    async def reading() -> bool:
        return held.reading

    await wait_until(reading)  # the prefill engine keeps them while they are read
    assert "p" in prefill.connector.held and free(prefill) == BLOCKS - 1 - 4
    await pulled(leg)
    assert time.monotonic() - started >= 13 * 4000 / 1e6
    assert step(decode)[0].scheduled == [(leg, 1)]


async def test_a_pull_after_the_lease_fails_the_request_and_the_engine_serves_on():
    prefill, decode = engine(timeout_s=0.05), engine()
    link(decode, prefill)
    assert prefill.connector is not None
    prefill.connector.start()  # its lease reaper
    try:
        prefilled = prefill_leg(prefill)

        async def expired() -> bool:
            return not prefill.connector.held if prefill.connector else False

        await wait_until(expired, within=5)
        assert free(prefill) == BLOCKS - 1 and prefill.cached_prefix_tokens(PROMPT) == 12
        leg = decode.submit(decode_leg(prefilled))
        step(decode)
        await pulled(leg)
        assert leg.remote is not None and leg.remote.state == FAILED and "lease expired" in leg.remote.error
        _, events = step(decode)
        assert leg.failed and leg.finished.is_set() and not leg.output and not events
        assert leg not in decode.loading and free(decode) == BLOCKS - 1  # its blocks freed, uncached
        assert leg.tokens.get_nowait() is None and decode.stats.prompt_tokens == 0
        assert decode.cached_prefix_tokens(PROMPT) == 0
        after = SimRequest("after", PROMPT, max_tokens=2)
        serve(decode, after)
        assert len(after.output) == 2 and not after.failed
    finally:
        await prefill.connector.close()


async def test_a_pull_of_blocks_the_prefill_engine_does_not_hold_fails():
    prefill, decode = engine(), engine()
    link(decode, prefill)
    assert prefill.connector is not None
    prefilled = prefill_leg(prefill)
    ids = [b.block_id for b in prefill.connector.held["p"].blocks]
    with pytest.raises(TransferError, match="is not this one"):
        prefill.connector.claim("another-engine", "p", ids)
    with pytest.raises(TransferError, match="no KV held for request q"):
        prefill.connector.claim(prefill.connector.engine_id, "q", ids)
    with pytest.raises(TransferError, match="holds no block"):
        prefill.connector.claim(prefill.connector.engine_id, "p", [*ids, BLOCKS + 5])
    other = decode.submit(decode_leg(prefilled, prompt=[*PROMPT[:12], 9], name="other prompt"))
    step(decode)
    await pulled(other)  # the blocks hold another prompt's KV: read (and freed there), not used
    assert other.remote is not None and other.remote.state == FAILED and "another prompt" in other.remote.error
    step(decode)
    assert other.failed and not prefill.connector.held
    late = decode.submit(decode_leg(prefilled, name="read twice"))
    step(decode)
    await pulled(late)
    assert late.remote is not None and late.remote.state == FAILED and "already read" in late.remote.error


async def test_an_aborted_decode_leg_lets_the_prefill_engine_free_its_blocks():
    prefill, decode = engine(), engine(ms_per_1k=2000.0)
    link(decode, prefill)
    assert prefill.connector is not None and decode.connector is not None
    unread = decode.submit(decode_leg(prefill_leg(prefill, name="a"), name="unread"))
    decode.abort(unread)  # before its admission: the prefill engine is told to free them now

    async def freed() -> bool:
        return "a" not in prefill.connector.held if prefill.connector else False

    await wait_until(freed, within=5)
    loading = decode.submit(decode_leg(prefill_leg(prefill, name="b"), name="loading"))
    step(decode)
    decode.abort(loading)  # while it pulls: its blocks stay until the read is over (vLLM's delay_free_blocks)
    assert loading in decode.loading and free(decode) < BLOCKS - 1
    await pulled(loading)
    step(decode)
    assert loading not in decode.loading and free(decode) == BLOCKS - 1 and not loading.failed
    assert decode.cached_prefix_tokens(PROMPT) == 0 and not prefill.connector.held
    await decode.connector.close()


async def test_loaded_decode_legs_go_before_the_queue_and_within_the_batch_limit():
    prefill, decode = engine(), engine(seqs=1)
    link(decode, prefill)
    leg = decode.submit(decode_leg(prefill_leg(prefill)))
    step(decode)
    queued = decode.submit(SimRequest("queued", list(range(400, 405)), max_tokens=1))
    await pulled(leg)
    plan, _ = step(decode)
    assert plan.scheduled == [(leg, 1)] and decode.waiting[0] is queued  # max-num-seqs 1: the leg first
    while not leg.finished.is_set():
        step(decode)
    assert step(decode)[0].tokens_of(queued) == 5


def test_kv_transfer_params_are_ignored_without_a_connector_and_checked_with_one():
    params = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_request_id": "r"}
    where = {**params, "remote_block_ids": [[1, 2]], "remote_host": "h", "remote_port": 8001}
    connector = KVConnector()

    def generation(value: object) -> api.Generation:
        return api.Generation([PROMPT], 4, False, False, None, False, kv_transfer_params=value)

    assert new_request(None, "x", PROMPT, generation(params)).remote is None  # no connector: as today
    assert new_request(None, "x", PROMPT, generation("junk")).remote is None
    for bad in ("junk", params, {**where, "remote_port": "8001"}, {**where, "remote_block_ids": [["a"]]}):
        with pytest.raises(api.ApiError) as raised:
            new_request(connector, "x", PROMPT, generation(bad))
        assert raised.value.status == 400 and raised.value.param == "kv_transfer_params"
    remote = new_request(connector, "x", PROMPT, generation(where)).remote
    assert remote == RemotePrefill("e", "r", [1, 2], "h", 8001)
    flat = new_request(connector, "x", PROMPT, generation({**where, "remote_block_ids": [3]})).remote
    assert flat is not None and flat.block_ids == [3]  # older vLLMs sent one flat list
    decode = new_request(connector, "x", PROMPT, generation({"do_remote_decode": True}))
    assert decode.remote_decode and decode.remote is None


def test_the_kv_transfer_settings(monkeypatch):
    parser = build_parser()
    settings = settings_from_args(parser.parse_args([]))
    assert (settings.kv_transfer, settings.kv_transfer_ms_per_1k_tokens, settings.kv_transfer_timeout_s) == (
        False,
        5.0,
        30.0,
    )
    flags = ["--kv-transfer", "--kv-transfer-ms-per-1k-tokens", "2.5", "--kv-transfer-timeout-s", "480"]
    settings = settings_from_args(parser.parse_args(flags))
    assert (settings.kv_transfer, settings.kv_transfer_ms_per_1k_tokens, settings.kv_transfer_timeout_s) == (
        True,
        2.5,
        480.0,
    )
    assert settings.kv_transfer_address == "127.0.0.1"
    assert SimEngineSettings(host="0.0.0.0").kv_transfer_address == "localhost"
    assert SimEngineSettings(kv_transfer_host="engine-3").kv_transfer_address == "engine-3"
    monkeypatch.setenv("KVROUTE_SIM_KV_TRANSFER", "true")
    monkeypatch.setenv("KVROUTE_SIM_KV_TRANSFER_TIMEOUT_S", "12")
    settings = settings_from_args(build_parser().parse_args([]))
    assert settings.kv_transfer and settings.kv_transfer_timeout_s == 12
    monkeypatch.setenv("KVROUTE_SIM_KV_TRANSFER", "maybe")
    with pytest.raises(ValueError, match="KVROUTE_SIM_KV_TRANSFER must be 1 or 0"):
        settings_from_args(build_parser().parse_args([]))
    with pytest.raises(ValueError, match="--kv-transfer-timeout-s must be > 0"):
        SimEngineSettings(kv_transfer_timeout_s=0)
    with pytest.raises(ValueError, match="--kv-transfer-ms-per-1k-tokens must be >= 0"):
        SimEngineSettings(kv_transfer_ms_per_1k_tokens=-1)
    with pytest.raises(ValueError, match="cannot be combined with --cpu-blocks or --sliding-window"):
        SimEngineSettings(kv_transfer=True, cpu_blocks=8)
    with pytest.raises(ValueError, match="one full-attention group"):
        SimEngine(8, 4, TimingModel(), sliding_window=8, connector=KVConnector())


# --- over HTTP: the engines' apps, in this process ------------------------------------------------


def http_settings(**overrides: object) -> SimEngineSettings:
    base: dict[str, object] = {
        "port": 0,
        "events_endpoint": None,
        "num_blocks": BLOCKS,
        "block_size": BS,
        "max_model_len": 256,
        "kv_transfer": True,
        "timing": TimingModel(speedup=100.0),
    }
    return SimEngineSettings(**{**base, **overrides})  # type: ignore[arg-type]


@pytest.fixture
async def pair() -> AsyncIterator[tuple[RunningEngine, RunningEngine]]:
    async with running_engine(http_settings()) as prefill, running_engine(http_settings()) as decode:
        yield prefill, decode


async def post(url: str, body: object, path: str = "/v1/completions") -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session, session.post(url + path, json=body) as response:
        return response.status, await response.json(content_type=None)


async def test_the_pull_endpoint_reads_once_and_refuses_what_it_does_not_hold(pair):
    prefill, _ = pair
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": PREFILL_PARAMS}
    status, reply = await post(prefill.url, body)
    params = reply["kv_transfer_params"]
    assert status == 200 and params["remote_port"] == int(prefill.url.rsplit(":", 1)[1])
    read = {k: params[k] for k in ("remote_engine_id", "remote_request_id", "remote_block_ids")}
    status, answer = await post(prefill.url, {**read, "read_s": -1}, "/kv_transfer/pull")
    assert status == 400 and answer["error"]["message"] == "'read_s' must be a number of seconds >= 0"
    status, answer = await post(prefill.url, read, "/kv_transfer/pull")
    assert status == 200 and answer == {"token_ids": PROMPT}
    status, answer = await post(prefill.url, read, "/kv_transfer/pull")
    assert status == 404 and "already read" in answer["error"]["message"]
    status, _ = await post(prefill.url, {"remote_engine_id": "x", "request_ids": ["a"]}, "/kv_transfer/heartbeat")
    assert status == 200


async def test_heartbeats_of_a_queued_decode_leg_renew_the_prefill_engines_lease():
    slow = TimingModel(speedup=1.0, max_num_seqs=1, decode_ms_per_step=20)
    async with (
        running_engine(http_settings(kv_transfer_timeout_s=1.2)) as prefill,
        running_engine(http_settings(kv_transfer_timeout_s=0.3, timing=slow)) as decode,
    ):
        assert prefill.engine.connector is not None
        blocker = asyncio.create_task(post(decode.url, {"model": "tiny", "prompt": [5, 6], "max_tokens": 100}))

        async def blocked() -> bool:
            return len(decode.engine.running) == 1

        await wait_until(blocked)
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": PREFILL_PARAMS}
        _, reply = await post(prefill.url, body)
        held = prefill.engine.connector.held[reply["kv_transfer_params"]["remote_request_id"]]
        first = held.expires
        leg = asyncio.create_task(post(decode.url, {**body, "kv_transfer_params": reply["kv_transfer_params"]}))

        async def renewed() -> bool:  # a heartbeat every 0.05 s: the lease moves to 0.8 s from then
            return held.expires > first

        await wait_until(renewed, within=5)
        assert (await blocker)[0] == 200
        status, answer = await leg
        assert status == 200 and answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert not prefill.engine.connector.held


async def test_a_decode_leg_the_engine_refuses_lets_the_prefill_engine_free_its_blocks():
    prefill, decode = engine(), engine()
    link(decode, prefill)
    assert prefill.connector is not None
    prefilled = prefill_leg(prefill)
    with pytest.raises(RequestRejected, match="maximum context length"):
        decode.submit(decode_leg(prefilled, max_tokens=5000))  # vLLM's serving layer refuses it, then frees

    async def freed() -> bool:
        return not prefill.connector.held if prefill.connector else False

    await wait_until(freed, within=5)
    assert free(prefill) == BLOCKS - 1
