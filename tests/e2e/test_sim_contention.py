"""Contention in the simulated engine over real HTTP: time to first token under chunked prefill,
decodes during a long prefill, and the metrics a router learns from (vLLM's names, label sets and
buckets, checked against the real vLLM 0.32 capture).

Requests go in over HTTP; their timestamps are read from the engine's own request records
(``SimRequest``: when each token was sampled), found in the engine's queues once submitted. Only
ratios and orders are asserted, never absolute times."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from sim_engine.engine import SimEngine, SimRequest, TimingModel
from sim_engine.server import RunningEngine, running_engine
from sim_engine.settings import SimEngineSettings
from tests.conftest import CAPTURES
from tests.support import wait_until

BS = 16
BUDGET = 64
LONG = [(i * 7) % 1900 + 20 for i in range(640)]  # 10 chunks of BUDGET tokens
SHORTS = [[(i * 11 + 100 * n) % 1900 + 20 for i in range(48)] for n in range(1, 4)]


def timing(budget: int = BUDGET) -> TimingModel:
    # 2 ms per prefill token: a full chunk is ~65 ms of simulated time (halved by the speedup)
    return TimingModel(
        prefill_ms_per_1k_tokens=2000,
        decode_ms_per_step=2,
        step_overhead_ms=1,
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        speedup=2,
    )


def settings(budget: int = BUDGET) -> SimEngineSettings:
    return SimEngineSettings(
        port=0,
        events_endpoint=None,
        num_blocks=256,
        block_size=BS,
        max_model_len=2048,
        timing=timing(budget),
    )


async def complete(session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens}
    async with session.post(url + "/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def submitted(engine: SimEngine, prompt: list[int]) -> SimRequest:
    """The engine's record of the request with ``prompt``, once it is queued or running."""
    found: list[SimRequest] = []

    async def queued() -> bool:
        found[:] = [r for r in [*engine.running, *engine.waiting] if r.prompt == prompt]
        return bool(found)

    await wait_until(queued, 10, interval=0.005)
    return found[0]


async def test_queued_prefill_tokens_delay_the_first_token_in_arrival_order():
    """A long prompt (10 chunks) runs; three short ones queue behind it. Running requests take the
    budget first (vLLM v1's FCFS), so no short prompt overtakes the long one: the first one is
    prefilled in the step after the long one's last chunk, the others in the steps after it, each
    first token later than the previous. A short prompt alone gets its first token in one step."""
    async with running_engine(settings()) as sim, aiohttp.ClientSession() as session:
        alone = asyncio.create_task(complete(session, sim.url, [5, *SHORTS[0]], 3))
        baseline = await submitted(sim.engine, [5, *SHORTS[0]])
        await alone
        tasks = [asyncio.create_task(complete(session, sim.url, LONG, 4))]
        long = await submitted(sim.engine, LONG)
        shorts = []
        for prompt in SHORTS:
            tasks.append(asyncio.create_task(complete(session, sim.url, prompt, 4)))
            shorts.append(await submitted(sim.engine, prompt))
        assert long.first_token_at is None, "the long prefill ended before the short prompts were queued"
        await asyncio.gather(*tasks)

    def ttft(request: SimRequest) -> float:
        assert request.first_token_at is not None
        return request.first_token_at - request.arrived

    firsts = [r.first_token_at or 0.0 for r in (long, *shorts)]
    assert firsts == sorted(firsts) and len(set(firsts)) == 4, "first tokens in queue order, one step apart"
    assert firsts[1] - firsts[0] < 0.25 * ttft(long)  # right after the long prefill, not after another one
    assert ttft(shorts[0]) > 4 * ttft(baseline)  # the long prefill queued ahead dominates


async def longest_gap_during_a_long_prefill(budget: int) -> tuple[float, float]:
    """A request decodes while a long prompt arrives: the longest gap between its tokens while the
    long prompt is prefilled, and that prefill's time to first token."""
    async with running_engine(settings(budget)) as sim, aiohttp.ClientSession() as session:
        decoding = asyncio.create_task(complete(session, sim.url, SHORTS[0], 300))
        decoder = await submitted(sim.engine, SHORTS[0])

        async def decodes() -> bool:
            return len(decoder.output) >= 2

        await wait_until(decodes, 10, interval=0.005)
        long_task = asyncio.create_task(complete(session, sim.url, LONG, 1))
        long = await submitted(sim.engine, LONG)
        await long_task
        assert long.first_token_at is not None
        assert not decoder.finished.is_set(), "the decoding request ended before the long prefill"
        end = long.first_token_at + 1e-6
        before = [t for t in decoder.token_times if t < long.arrived][-1:]
        during = [t for t in decoder.token_times if long.arrived <= t <= end]
        times = before + during + [t for t in decoder.token_times if t > end][:1]
        gaps = [b - a for a, b in itertools.pairwise(times)]
        decoding.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await decoding
        return max(gaps), long.first_token_at - long.arrived


async def test_chunked_prefill_keeps_decodes_flowing_during_a_long_prefill():
    """With a token budget, a decoding request gets a token every step while a long prompt is
    prefilled beside it (a gap of one chunk); without one (0), it waits for the whole prefill."""
    chunked_gap, chunked_ttft = await longest_gap_during_a_long_prefill(BUDGET)
    whole_gap, whole_ttft = await longest_gap_during_a_long_prefill(0)
    assert chunked_gap < 0.3 * whole_gap
    assert chunked_gap < 0.3 * chunked_ttft  # ~1/10 of the long prefill: one chunk's step
    assert whole_gap > 0.8 * whole_ttft  # the decode waited for the whole prefill step


def families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def label_names(family: Any) -> set[str]:
    return {name for sample in family.samples for name in sample.labels} - {"le"}


def buckets(family: Any) -> list[str]:
    return [s.labels["le"] for s in family.samples if s.name.endswith("_bucket")]


async def scrape(sim: RunningEngine) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session, session.get(sim.url + "/metrics") as response:
        return families(await response.text())


async def test_metrics_have_vllms_names_labels_and_buckets_and_count_the_work():
    vllm = families((CAPTURES / "run1_metrics.txt").read_text())
    async with running_engine(settings()) as sim:
        async with aiohttp.ClientSession() as session:
            await complete(session, sim.url, LONG[:200], 3)
            await asyncio.gather(*(complete(session, sim.url, [*LONG[:64], *s], 3) for s in SHORTS))
        got = await scrape(sim)
    same_shape = {
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:prefix_cache_queries": "counter",
        "vllm:prefix_cache_hits": "counter",
        "vllm:prompt_tokens": "counter",
        "vllm:prompt_tokens_cached": "counter",
        "vllm:prompt_tokens_by_source": "counter",
        "vllm:generation_tokens": "counter",
        "vllm:num_preemptions": "counter",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
        "vllm:request_queue_time_seconds": "histogram",
        "vllm:request_prefill_time_seconds": "histogram",
        "vllm:iteration_tokens_total": "histogram",
    }
    for name, kind in same_shape.items():
        assert (got[name].type, vllm[name].type) == (kind, kind), name
        assert label_names(got[name]) == label_names(vllm[name]), name
        assert got[name].documentation == vllm[name].documentation, name
        assert buckets(got[name]) == buckets(vllm[name]), name
    sources = {s.labels["source"] for s in got["vllm:prompt_tokens_by_source"].samples if s.name.endswith("_total")}
    assert sources == {s.labels["source"] for s in vllm["vllm:prompt_tokens_by_source"].samples}
    info = got["vllm:cache_config_info"].samples[0].labels
    assert set(info) <= set(vllm["vllm:cache_config_info"].samples[0].labels)
    assert (info["num_gpu_blocks"], info["block_size"]) == ("256", str(BS))

    def value(name: str, suffix: str = "_total", **labels: str) -> float:
        return next(
            s.value for s in got[name].samples if s.name == name + suffix and labels.items() <= s.labels.items()
        )

    prompts = 200 + 3 * (64 + 48)
    cached = 3 * 64  # the shorts share the long prompt's first 64 tokens (4 blocks)
    assert value("vllm:prompt_tokens") == prompts and value("vllm:prompt_tokens_cached") == cached
    assert value("vllm:prompt_tokens_by_source", source="local_compute") == prompts - cached
    assert value("vllm:time_to_first_token_seconds", "_count") == 4
    assert value("vllm:inter_token_latency_seconds", "_count") == 4 * 2
    assert value("vllm:request_prefill_time_seconds", "_count") == 4
    assert value("vllm:request_queue_time_seconds", "_count") == 4
    assert value("vllm:iteration_tokens_total", "_sum") == prompts - cached + 4 * 2  # computed prompt tokens, decodes
    assert value("vllm:num_requests_running", "") == 0 and value("vllm:num_requests_waiting", "") == 0
