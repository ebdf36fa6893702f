"""``kvroute bench replay TRACE``: routing quality on a real trace, routers side by side.

Replays a Mooncake-format trace (or a built-in workload, :mod:`kvroute.bench.replay_workload`) through a
self-started stack: simulated engines whose caches together hold ``--cache-fraction`` of the
replayed requests' distinct blocks, an agent per engine, and N kvroute router replicas per policy,
optionally the SGLang router in front of the same engines (``--peer sglang``, N independent
replicas), or through routers already running (``--router-url``). Requests go open loop at the
trace's timestamps divided by ``--time-scale``, or at a fixed ``--concurrency``. Every run starts
from empty engine caches. Outputs are capped (``--max-output``): the cache is what is measured.

Two references are computed offline from the same requests: one shared LRU cache with the fleet's
total capacity, and an infinite cache (the ceiling); each run's hit rate (engine-reported cached
tokens / prompt tokens) is also shown as a fraction of the LRU one.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from kvindex.settings import RedisSettings
from kvroute import charts
from kvroute.bench.common import cached_tokens, percentile, write_json
from kvroute.bench.lost_split import degraded_share, lost_during, lost_from_exposition, lost_shares
from kvroute.bench.probe import Prober, probe_split
from kvroute.bench.replay_chart import chart
from kvroute.bench.replay_report import averages, render
from kvroute.bench.replay_workload import (
    TRACE_BLOCK,
    TextPrompts,
    TraceRequest,
    load_trace,
    reference_hit_rates,
    synthetic_trace,
    tokens_of,
)
from kvroute.devstack.embedded_redis import RedisServer
from kvroute.devstack.peers import GreedyOracle, SglangRouters
from kvroute.devstack.stack import MODEL, Stack, stream_completion, whole_completion
from kvservice.lifecycle import StartupError
from kvtokens.tokenizer import ModelPrompts
from router.routing.scoring import Policy
from sim_engine.engine import TimingModel
from sim_engine.settings import TINY_MODEL_DIR

TIME_WINDOWS = 20  # points of the hit-rate-over-time curve
GREEDY_ORACLE = "greedy_oracle"  # the reference router that asks the engines (kvroute.devstack.oracle)
PEERS = ("sglang", GREEDY_ORACLE)  # routers that are not kvroute's, which count no lost tokens
# kvroute's router with other settings, for comparison: lower cache tiers ignored (only the GPU's
# blocks count, the router before tiers), fixed weights per tier (Dynamo's 1.0 / 0.75 / 0.25), and the
# tiers' load costs learned from TTFTs
ROUTER_VARIANTS = {
    "kv_no_tiers": (Policy.KV, ("--tier-cost", "ignore")),
    "kv_tier_weights": (Policy.KV, ("--tier-cost", "weights")),
    "kv_tier_learned": (Policy.KV, ("--tier-cost", "learned")),  # the load costs learned from TTFTs
    # the prefill queued ahead not priced (only the delay a prompt adds behind it): how much of kv's
    # hit rate its load trade gives up, and what the trade buys in TTFT (docs/benchmarks.md)
    "kv_no_queue": (Policy.KV, ("--weight-queued", "0")),
    # prefill/decode fleets (router.routing.pd): the same engines served whole, and the baselines
    # that split every request, each leg by their own rule
    "kv_aggregated": (Policy.KV, ("--pd-split", "off")),
    # prefill workers kept off whole requests (llm-d's and Dynamo's way): split or whole on a decode worker
    "kv_pd_strict": (Policy.KV, ("--pd-whole-on", "decode")),
    "kv_pd_whole": (Policy.KV, ("--pd-split", "never", "--pd-whole-on", "decode")),  # the decode workers alone
    "kv_pd_always": (Policy.KV, ("--pd-split", "always")),
    "round_robin_pd": (Policy.ROUND_ROBIN, ("--pd-split", "always")),
    "least_loaded_pd": (Policy.LEAST_LOADED, ("--pd-split", "always")),
}


@dataclass
class RunResult:
    router: str  # a kvroute policy, "sglang", or "external"
    replicas: int
    requests: int
    failed: int
    hit_rate: float
    of_lru_reference: float
    ttft_mean_ms: float
    ttft_p99_ms: float
    busiest_worker_vs_mean: float
    ttft_ms: list[float]
    hit_rate_over_time: list[float]
    engine_ttft_mean_ms: float = 0.0  # the engines' own vllm:time_to_first_token_seconds, this run's mean
    # Lost prefix tokens by reason, as shares of the cacheable tokens (docs/dashboard.md); None for a peer.
    lost_share: dict[str, float] | None = None
    # Decisions its routers made without Redis (round robin past their budget), of all; None for a peer.
    degraded_share: float | None = None
    # Requests whose predicted cached tokens (x-kvroute-cached-tokens) equalled the engine's report,
    # of those predicted; None for a router that predicts nothing (SGLang's)
    prediction_exact: float | None = None
    # the hit rate split by what the engines held at each send (kvroute.bench.probe); None: not probed
    probe_split: dict[str, float] | None = None
    repeat: int = 0  # which of --repeats this run is (from 0)
    # the mean inter-token latency over streamed replies of more than one token (None: none)
    itl_mean_ms: float | None = None
    split_share: float = 0.0  # of the answered requests, those split over a prefill and a decode worker


async def router_lost_tokens(urls: list[str]) -> dict[str, float] | None:
    """The lost prefix tokens and cacheable tokens the routers at ``urls`` counted so far, summed
    (:func:`kvroute.bench.lost_split.lost_from_exposition`); None when they export no accounting."""
    totals: dict[str, float] | None = None
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        for url in urls:
            async with session.get(url + "/metrics") as response:
                found = lost_from_exposition(await response.text()) if response.status == 200 else None
            if found is not None:
                totals = {key: (totals or {}).get(key, 0.0) + value for key, value in found.items()}
    return totals


async def _one(
    session: aiohttp.ClientSession, url: str, prompt: list[int] | str, max_tokens: int, stream: bool
) -> dict[str, Any]:
    """One request; ``ttft`` is the time to the first streamed event or, not streamed, to the whole reply."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}
    reply = await (stream_completion if stream else whole_completion)(session, url, "/v1/completions", body)
    if reply.status != 200:
        return {"failed": True}
    ttft = reply.ttft_s if stream else reply.latency_s
    usage = reply.usage or {}
    # the mean inter-token latency of a streamed reply: its decode time over its later tokens
    completion = usage.get("completion_tokens")
    completion = completion if isinstance(completion, int) else 0
    itl = (reply.latency_s - reply.ttft_s) / (completion - 1) if stream and completion > 1 else None
    # the router's predicted cached tokens (x-kvroute-cached-tokens; None from a router that sends none)
    predicted = reply.predicted_cached_tokens if reply.predicted_known else None
    result = {"failed": False, "ttft": ttft, "usage": usage, "worker": reply.worker, "predicted": predicted}
    return {**result, "itl": itl, "split": bool(reply.prefill_worker)}


async def send_all(
    urls: list[str],
    requests: list[TraceRequest],
    prompts: list[Any],
    args: argparse.Namespace,
    after: Sequence[int | None] = (),
    stream: bool = True,
    prober: Prober | None = None,
) -> list[dict[str, Any]]:
    """Every request once, spread over ``urls`` in turn: open loop at the (scaled) timestamps, or
    ``args.concurrency`` at a time. Results come in completion order; with a ``prober``, each
    result's ``probe`` is what every engine held of its prompt just before it was sent.

    ``after[i]``, when given and not None, is a request that must have been answered before request
    i is sent (a conversation's previous turn): i then goes at its timestamp or at that answer,
    whichever is later, and its result's ``held_s`` says how long it waited past its timestamp.
    Not ``stream``: non-streamed requests, whose ``ttft`` is the time to the whole reply."""
    results: list[dict[str, Any]] = []
    start = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=600)
    answered = [asyncio.Event() for _ in requests] if after else []

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:

        async def send(i: int) -> None:
            due = time.perf_counter()
            if after and (previous := after[i]) is not None:
                await answered[previous].wait()
            held = time.perf_counter() - due
            max_tokens = min(requests[i].output_length, args.max_output)
            try:
                probe = await prober.cached(session, prompts[i]) if prober else None
                result = await _one(session, urls[i % len(urls)], prompts[i], max_tokens, stream)
            finally:
                if answered:
                    answered[i].set()
            results.append({**result, "held_s": held, "probe": probe})

        async def at_timestamp(i: int) -> None:
            delay = start + requests[i].at_s / args.time_scale - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            await send(i)

        if args.concurrency:
            queue = iter(range(len(requests)))

            async def client() -> None:
                for i in queue:
                    await send(i)

            await asyncio.gather(*(client() for _ in range(args.concurrency)))
        else:
            await asyncio.gather(*(at_timestamp(i) for i in range(len(requests))))
    return results


def summarize(
    router: str, replicas: int, results: list[dict[str, Any]], per_worker: list[int], lru: float
) -> RunResult:
    done = [r for r in results if not r["failed"]]
    prompt = [r["usage"].get("prompt_tokens", 0) for r in done]
    cached = [cached_tokens(r["usage"]) for r in done]
    ttfts = sorted(1000 * r["ttft"] for r in done) or [0.0]
    hit_rate = sum(cached) / max(sum(prompt), 1)
    window = max(1, len(done) // TIME_WINDOWS)
    over_time = [sum(cached[i : i + window]) / max(sum(prompt[i : i + window]), 1) for i in range(0, len(done), window)]
    mean_share = sum(per_worker) / max(len(per_worker), 1)
    predicted = [(r["predicted"], cached_tokens(r["usage"])) for r in done if r.get("predicted") is not None]
    exact = sum(1 for p, c in predicted if p == c) / len(predicted) if predicted else None
    itls = [1000 * r["itl"] for r in done if r.get("itl") is not None]
    return RunResult(
        router=router,
        replicas=replicas,
        requests=len(results),
        failed=len(results) - len(done),
        hit_rate=hit_rate,
        of_lru_reference=hit_rate / max(lru, 1e-9),
        ttft_mean_ms=statistics.mean(ttfts),
        ttft_p99_ms=percentile(ttfts, 0.99),
        busiest_worker_vs_mean=max(per_worker, default=0) / max(mean_share, 1e-9),
        ttft_ms=[round(t, 2) for t in ttfts],
        hit_rate_over_time=[round(h, 4) for h in over_time],
        prediction_exact=None if exact is None else round(exact, 4),
        itl_mean_ms=round(statistics.mean(itls), 3) if itls else None,
        split_share=round(sum(1 for r in done if r.get("split")) / max(len(done), 1), 4),
    )


@asynccontextmanager
async def router_urls(
    stack: Stack, router: str, replicas: int, sglang_args: tuple[str, ...] = ()
) -> AsyncIterator[list[str]]:
    """``replicas`` URLs of ``router`` (a kvroute policy or variant, "sglang" with
    ``sglang_args``, the greedy oracle) over ``stack``'s engines, until the block exits."""
    if router == "sglang":
        async with SglangRouters(stack.engine_urls, replicas, extra_args=sglang_args) as sglang:
            yield sglang.urls
        return
    if router == GREEDY_ORACLE:
        async with GreedyOracle(stack.engine_urls, replicas) as oracle:
            yield oracle.urls
        return
    policy, flags = ROUTER_VARIANTS[router] if router in ROUTER_VARIANTS else (Policy(router), ())
    try:
        yield await stack.start_routers(policy, replicas, flags)
    finally:
        await stack.stop_routers()


async def replay_on_stack(
    stack: Stack,
    router: str,
    replicas: int,
    requests: list[TraceRequest],
    prompts: list[Any],
    args: argparse.Namespace,
    lru: float,
    after: Sequence[int | None] = (),
    stream: bool = True,
    probe: bool = False,
) -> tuple[RunResult, list[dict[str, Any]]]:
    """One run from empty engine caches through ``router`` (a policy or "sglang"): its summary, and
    the requests' results (:func:`send_all`); ``probe``: each request's engines asked first
    (:mod:`kvroute.bench.probe`)."""
    await stack.reset_caches()
    before = await stack.requests_per_engine()
    ttft_before = await _engine_ttft(stack)
    prober = Prober(stack.engine_urls, ModelPrompts(TINY_MODEL_DIR)) if probe else None
    async with router_urls(stack, router, replicas) as urls:
        results = await send_all(urls, requests, prompts, args, after, stream, prober)
        lost = await router_lost_tokens(urls) if router not in PEERS else None  # fresh routers: from 0
    done = await stack.requests_per_engine()
    ttft_done = await _engine_ttft(stack)
    per_worker = [b - a for a, b in zip(before, done, strict=True)]
    run = summarize(router, replicas, results, per_worker, lru)
    run.lost_share, run.degraded_share = lost_shares(lost), degraded_share(lost)
    run.probe_split = probe_split(results, stack.engine_urls) if probe else None
    seconds, count = (b - a for a, b in zip(ttft_before, ttft_done, strict=True))
    run.engine_ttft_mean_ms = 1000 * seconds / max(count, 1)
    return run, results


async def _engine_ttft(stack: Stack) -> tuple[float, float]:
    """(sum of seconds, count) of every engine's time-to-first-token histogram."""
    seconds = await stack.engine_metric("vllm:time_to_first_token_seconds_sum")
    count = await stack.engine_metric("vllm:time_to_first_token_seconds_count")
    return sum(seconds), sum(count)


def prompts_for(requests: list[TraceRequest], text: bool) -> list[Any]:
    if text:
        texts = TextPrompts(ModelPrompts(TINY_MODEL_DIR))
        return [texts.text_of(r) for r in requests]
    cache: dict[int, list[int]] = {}
    return [tokens_of(r, cache) for r in requests]


def _routers(args: argparse.Namespace) -> list[str]:
    routers = [Policy(p).value for p in args.policies.split(",") if p]
    return routers + peers_of(args)


def peers_of(args: argparse.Namespace) -> list[str]:
    """``--peer``'s routers (comma-separated: sglang, greedy_oracle)."""
    return list(dict.fromkeys(p.strip() for p in (args.peer or "").split(",") if p.strip()))


def fleet_capacity(
    requests: list[TraceRequest],
    cache_fraction: float,
    engines: int,
    block_size: int,
    max_output: int,
    block_tokens: int = TRACE_BLOCK,
) -> tuple[int, int, int]:
    """(fleet capacity in trace blocks, blocks per engine, max model length in tokens) for caches
    that together hold ``cache_fraction`` of the requests' distinct blocks (``block_tokens``
    tokens each: the trace's 512, or the engines' block size for a workload hashed as they hash)."""
    distinct = len({h for r in requests for h in r.hash_ids})
    capacity_trace_blocks = max(1, int(distinct * cache_fraction))
    per_engine_blocks = capacity_trace_blocks * (block_tokens // block_size) // engines + 1
    needed = max(r.input_length + max_output for r in requests) // block_size + 2
    if per_engine_blocks < needed:
        # An engine must fit the largest request: grow the caches and say so (the references use
        # the same, effective capacity).
        print(
            f"note: {cache_fraction:.0%} of the distinct blocks gives each engine {per_engine_blocks} blocks, "
            f"less than the largest request's {needed}: using {needed}",
            file=sys.stderr,
        )
        per_engine_blocks = needed
        capacity_trace_blocks = per_engine_blocks * engines * block_size // block_tokens
    return capacity_trace_blocks, per_engine_blocks, needed * block_size


def check_args(args: argparse.Namespace) -> None:
    """Combinations argparse cannot check: a :class:`StartupError` (one line, exit status 2)."""
    if (args.trace is None) == (args.synthetic is None):
        raise StartupError("give a TRACE file or --synthetic KIND (one of them)")
    if args.concurrency < 0 or args.limit <= 0 or args.time_scale <= 0 or not 0 < args.cache_fraction <= 1:
        raise StartupError(
            "--concurrency >= 0, --limit > 0, --time-scale > 0 and 0 < --cache-fraction <= 1 are required"
        )
    if args.router_url and args.peer:
        raise StartupError("--peer needs the self-started stack, not --router-url")
    unknown = [p for p in peers_of(args) if p not in PEERS]
    if unknown or (args.peer is not None and not peers_of(args)):
        raise StartupError(f"--peer takes some of {','.join(PEERS)}, got {args.peer!r}")
    if args.router_url and getattr(args, "probe", False):
        raise StartupError("--probe needs the self-started stack (it asks the engines), not --router-url")
    if args.router_url and args.repeats > 1:
        raise StartupError(
            "--repeats needs the self-started stack (its caches are emptied between runs), not --router-url"
        )


def load_requests(args: argparse.Namespace) -> list[TraceRequest]:
    """The requests to replay; a missing or malformed trace is a :class:`StartupError` (file:line)."""
    try:
        if args.synthetic:
            requests = synthetic_trace(args.synthetic, args.limit)
        else:
            requests = load_trace(Path(args.trace), args.limit, args.max_input)
    except OSError as exc:
        raise StartupError(f"cannot read the trace {args.trace}: {exc.strerror or exc}") from None
    except ValueError as exc:  # a malformed row: file:line and what is wrong
        raise StartupError(str(exc)) from None
    if not requests:
        raise StartupError("no request to replay (check --limit and --max-input)")
    return requests


async def running_routers(flag: str) -> list[str]:
    """The ``--router-url`` replicas, each checked to be an http(s) URL that answers: anything else is
    a :class:`StartupError` naming it, before a request is sent."""
    urls = [u.strip().rstrip("/") for u in flag.split(",") if u.strip()]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        for url in urls:
            if urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).hostname:
                raise StartupError(f"--router-url must list http:// or https:// URLs, got {url!r}")
            try:
                async with session.get(url + "/health") as response:
                    status = response.status
            except (aiohttp.ClientError, TimeoutError) as exc:
                reason = str(exc) or type(exc).__name__
                raise StartupError(
                    f"cannot reach the router at {url}: {reason} (is it running? check --router-url)"
                ) from None
            if status != 200:
                raise StartupError(f"{url}/health answered {status}: is it a router? (check --router-url)")
    if not urls:
        raise StartupError("--router-url lists no URL")
    return urls


async def run_benchmark(args: argparse.Namespace, requests: list[TraceRequest]) -> dict[str, Any]:
    urls = await running_routers(args.router_url) if args.router_url else []
    text = args.prompts == "text" or "sglang" in peers_of(args)  # SGLang takes text only: every run gets text
    prompts = prompts_for(requests, text)
    distinct = len({h for r in requests for h in r.hash_ids})
    sizes = args.cache_fraction, args.engines, args.block_size, args.max_output
    capacity, per_engine_blocks, max_model_len = fleet_capacity(requests, *sizes)
    lru, infinite = reference_hit_rates(requests, capacity)
    engines = args.engines
    if urls:
        print(f"replaying {len(requests)} requests through {', '.join(urls)}", file=sys.stderr)
        lost_before = await router_lost_tokens(urls)
        results = await send_all(urls, requests, prompts, args)
        per_worker = Counter(r["worker"] for r in results if not r["failed"])
        engines = len(per_worker)  # the workers seen answering (x-kvroute-worker)
        runs = [summarize("external", len(urls), results, list(per_worker.values()), lru)]
        lost = lost_during(lost_before, await router_lost_tokens(urls))
        runs[0].lost_share, runs[0].degraded_share = lost_shares(lost), degraded_share(lost)
    else:
        runs = await _run_on_stack(requests, prompts, args, per_engine_blocks, max_model_len, lru)
    summary = {
        "requests": len(requests),
        "distinct_trace_blocks": distinct,
        "prompts": "text" if text else "token ids",
        "cache_fraction": capacity / distinct,
        "engines": engines,
        "lru_reference_hit_rate": lru,
        "infinite_cache_hit_rate": infinite,
        "runs": [asdict(r) for r in runs],
    }
    if args.repeats > 1:
        summary["averages"] = averages(summary["runs"])
    return summary


async def _run_on_stack(
    requests: list[TraceRequest],
    prompts: list[Any],
    args: argparse.Namespace,
    per_engine_blocks: int,
    max_model_len: int,
    lru: float,
) -> list[RunResult]:
    timing = TimingModel(
        prefill_ms_per_1k_tokens=args.prefill_ms_per_1k,
        decode_ms_per_step=5,
        max_running=args.max_running,
        speedup=args.time_scale,
        prefill_context_ns=getattr(args, "prefill_context_ns", 0.0),
    )
    runs = []
    probe = bool(getattr(args, "probe", False))
    with RedisServer() as server:
        redis = RedisSettings(url=server.url)
        sizes = {"num_blocks": per_engine_blocks, "block_size": args.block_size, "max_model_len": max_model_len}
        async with Stack(redis, engines=args.engines, timing=timing, **sizes) as stack:
            # Repeats go round the whole set, so that a machine slowing down meanwhile weighs on all alike.
            for repeat in range(args.repeats):
                for replicas in (int(r) for r in args.replicas.split(",")):
                    for router in _routers(args):
                        which = f" (repeat {repeat + 1} of {args.repeats})" if args.repeats > 1 else ""
                        print(
                            f"replaying {len(requests)} requests: {router}, {replicas} replica(s){which}",
                            file=sys.stderr,
                        )
                        run, _ = await replay_on_stack(
                            stack, router, replicas, requests, prompts, args, lru, probe=probe
                        )
                        run.repeat = repeat
                        runs.append(run)
    return runs


def run_from_args(args: argparse.Namespace) -> int:
    check_args(args)
    results = asyncio.run(run_benchmark(args, load_requests(args)))
    print(render(results))
    print(charts.written(lambda: chart(results, Path(args.chart)), Path(args.chart)))
    if args.json:
        write_json(args.json, results)
    return 0
