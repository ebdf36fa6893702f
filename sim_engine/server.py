"""The simulated engine's HTTP server: vLLM's OpenAI-compatible API over :class:`SimEngine`.

Start it in-process with :func:`running_engine` (tests, the demo, benchmarks) or as a process
with ``kvroute sim-engine`` (:mod:`sim_engine.main`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import zmq.asyncio
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kvevents import sglang
from kvevents.vllm import encode_payload
from kvservice.http_runner import OpenAIErrorsRunner
from kvservice.lifecycle import StartupError, listening
from kvservice.logs import access_log_middleware
from kvtokens.tokenizer import ModelPrompts
from sim_engine import api, kv_transfer_api, replies
from sim_engine.engine import RequestRejected, SimEngine
from sim_engine.faults import EngineFaults
from sim_engine.kv_events import KVEventPublisher
from sim_engine.kv_transfer import KVConnector
from sim_engine.lora import LoraAdapters, LoraError
from sim_engine.metrics import EngineCollector, RequestHistograms, SglangCollector
from sim_engine.settings import SimEngineSettings
from sim_engine.shared_compute import SharedCompute
from sim_engine.trtllm_events import OWNERS, TrtllmEventQueue

MAX_BODY_BYTES = 32 * 1024 * 1024
QUIET_PATHS = frozenset({"/metrics", "/health"})  # probes and scrapes: logged at DEBUG
access_log = logging.getLogger("sim_engine.access")


@dataclass
class _State:
    settings: SimEngineSettings
    engine: SimEngine
    prompts: ModelPrompts
    histograms: RequestHistograms
    registry: CollectorRegistry  # everything (/debug/metrics)
    public: CollectorRegistry  # what /metrics exports (--metrics)
    adapters: LoraAdapters = field(default_factory=LoraAdapters)


STATE = web.AppKey("state", _State)


def _error(exc: api.ApiError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status)


async def _json_body(request: web.Request) -> Any:
    try:
        return json.loads(await request.read())
    except ValueError as exc:
        raise api.ApiError(400, f"the request body is not valid JSON: {exc}") from None


async def _health(_: web.Request) -> web.Response:
    return web.Response(status=200)


async def _models(request: web.Request) -> web.Response:
    settings = request.app[STATE].settings
    entry = {
        "id": settings.model,
        "object": "model",
        "created": int(time.time()),
        "owned_by": OWNERS.get(settings.engine_kind, settings.engine_kind),
        "root": settings.model,
        "parent": None,
        "max_model_len": settings.max_model_len,
    }
    adapters = [
        {**entry, "id": a.name, "root": a.path, "parent": settings.model, "max_model_len": None}
        for a in request.app[STATE].adapters
    ]
    return web.json_response({"object": "list", "data": [entry, *adapters]})


async def _load_lora(request: web.Request) -> web.Response:
    """vLLM's POST /v1/load_lora_adapter ``{"lora_name", "lora_path"}``."""
    return await _change_lora(request, load=True)


async def _unload_lora(request: web.Request) -> web.Response:
    """vLLM's POST /v1/unload_lora_adapter ``{"lora_name"}``."""
    return await _change_lora(request, load=False)


async def _change_lora(request: web.Request, load: bool) -> web.Response:
    state = request.app[STATE]
    try:
        body = await _json_body(request)
        if not isinstance(body, dict) or not isinstance(body.get("lora_name"), str):
            raise api.ApiError(400, "the body must be an object with a string 'lora_name'")
        name = body["lora_name"]
        if load:
            state.adapters.load(name, str(body.get("lora_path") or ""))
        else:
            state.adapters.unload(name)
    except api.ApiError as exc:
        return _error(exc)
    except LoraError as exc:
        return _error(api.ApiError(exc.status, str(exc)))
    done = "added" if load else "removed"
    return web.Response(text=f"Success: LoRA adapter '{name}' {done} successfully.")


async def _tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        body = await _json_body(request)
        settings = state.settings
        return web.json_response(
            api.tokenize(body, settings.model, state.prompts, settings.max_model_len, state.adapters)
        )
    except api.ApiError as exc:
        return _error(exc)


async def _reset(request: web.Request) -> web.Response:
    if request.app[STATE].engine.reset_prefix_cache():
        return web.Response(status=200)
    return _error(api.ApiError(400, "requests are running: cannot reset the prefix cache"))


async def _cached_blocks(request: web.Request) -> web.Response:
    """The engine hashes in the prefix cache (for duplication measurements across engines); with
    ``?detail=1`` also each block's parent hash, token ids and salt, so that a checker can hash
    every chain the way the index does (the fault suite compares the index with this view)."""
    pool = request.app[STATE].engine.pool
    body: dict[str, Any] = {"cached_blocks": [f"{h:016x}" for h in pool.cached_hashes()]}
    if request.query.get("detail") in ("1", "true"):
        body["blocks"] = [
            {
                "hash": f"{h:016x}",
                "parent": None if c.parent is None else f"{c.parent:016x}",
                "token_ids": list(c.tokens),
                "salt": c.salt,
                "lora_name": c.lora_name,
            }
            for h, c in pool.cached_contents().items()
        ]
    return web.json_response(body)


async def _cached_prefix(request: web.Request) -> web.Response:
    """The prefix-cache hit a completions or chat body (``messages``) would get if scheduled now:
    ``{"prompt_tokens", "cached_tokens", "running", "waiting"}`` (an oracle router's question; a
    batch answers for its first prompt)."""
    state = request.app[STATE]
    try:
        body = await _json_body(request)
        parse = api.parse_chat if isinstance(body, dict) and "messages" in body else api.parse_completion
        generation = parse(body, state.settings.model, state.prompts, state.adapters)
    except api.ApiError as exc:
        return _error(exc)
    engine, prompt = state.engine, generation.prompts[0]
    cached = engine.cached_prefix_tokens(prompt, generation.keys)
    answer = {"prompt_tokens": len(prompt), "cached_tokens": cached}
    return web.json_response({**answer, "running": len(engine.running), "waiting": engine.num_waiting})


def _exposition(state: _State, registry: CollectorRegistry) -> web.Response:
    response = web.Response(body=state.engine.faults.metrics_text(generate_latest(registry).decode()))
    response.content_type = CONTENT_TYPE_LATEST.split(";")[0]
    return response


async def _metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    queue = state.engine.publisher
    if isinstance(queue, TrtllmEventQueue):  # trtllm-serve's /metrics: JSON iteration stats
        return web.json_response(queue.iteration_stats(state.engine))
    return _exposition(state, state.public)


async def _prometheus(request: web.Request) -> web.Response:
    """trtllm-serve's Prometheus page (TensorRT-LLM's engines only)."""
    state = request.app[STATE]
    return _exposition(state, state.public)


async def _kv_cache_events(request: web.Request) -> web.Response:
    """trtllm-serve's: the queued KV events, drained (TensorRT-LLM's engines only)."""
    queue = request.app[STATE].engine.publisher
    return web.json_response(queue.drain() if isinstance(queue, TrtllmEventQueue) else [])


async def _all_metrics(request: web.Request) -> web.Response:
    """Every metric, whatever ``--metrics`` exports (benchmarks count requests and TTFT from it)."""
    state = request.app[STATE]
    return _exposition(state, state.registry)


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, request.app[STATE], chat=False)


async def _chat(request: web.Request) -> web.StreamResponse:
    return await _generate(request, request.app[STATE], chat=True)


def create_app(state: _State) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[access_log_middleware(access_log, QUIET_PATHS)])
    app[STATE] = state
    app.router.add_get("/health", _health)
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/tokenize", _tokenize)
    app.router.add_post("/reset_prefix_cache", _reset)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/debug/cache", _cached_blocks)
    app.router.add_post("/debug/match", _cached_prefix)
    app.router.add_get("/debug/metrics", _all_metrics)
    if state.settings.engine_kind == "trtllm":
        app.router.add_post("/kv_cache_events", _kv_cache_events)
        app.router.add_get("/prometheus/metrics", _prometheus)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat)
    if state.settings.enable_lora:
        app.router.add_post("/v1/load_lora_adapter", _load_lora)
        app.router.add_post("/v1/unload_lora_adapter", _unload_lora)
    if state.engine.connector is not None:
        kv_transfer_api.add_routes(app, state.engine.connector)
    return app


async def _generate(request: web.Request, state: _State, chat: bool) -> web.StreamResponse:
    try:
        body = await _json_body(request)
        parse = api.parse_chat if chat else api.parse_completion
        generation = parse(body, state.settings.model, state.prompts, state.adapters)
        request_id = api.new_id(chat)
        connector = state.engine.connector
        submitted = [
            state.engine.submit(kv_transfer_api.new_request(connector, f"{request_id}-{i}", prompt, generation))
            for i, prompt in enumerate(generation.prompts)
        ]
    except api.ApiError as exc:
        return _error(exc)
    except RequestRejected as exc:
        return _error(api.ApiError(400, str(exc)))
    try:
        if generation.stream:
            return await replies.stream(request, state, generation, request_id, submitted)
        texts = await asyncio.gather(*(replies.collect(state, r) for r in submitted))
        if any(r.failed for r in submitted):
            return _error(api.generation_error())
        ids = [(r.prompt, r.output) for r in submitted] if generation.return_token_ids else None
        model = generation.lora.name if generation.lora is not None else state.settings.model
        body = api.completion(request_id, model, chat, list(texts), replies.usage(submitted), ids)
        if connector is not None:  # vLLM's reply has it with a KV connector: null but on a prefill leg
            body["kv_transfer_params"] = submitted[0].kv_transfer_out
        return web.json_response(body)
    finally:
        for sim_request in submitted:
            if not sim_request.finished.is_set():
                state.engine.abort(sim_request)  # the client went away


@dataclass
class RunningEngine:
    """A started engine: where to reach it, and its parts (for tests and the demo)."""

    url: str
    events_endpoint: str | None
    replay_endpoint: str | None
    engine: SimEngine
    publisher: KVEventPublisher | TrtllmEventQueue | None

    @property
    def faults(self) -> EngineFaults:
        """Knobs that make this engine misbehave while it runs (tests only)."""
        return self.engine.faults


def _state(settings: SimEngineSettings, engine: SimEngine, prompts: ModelPrompts) -> _State:
    registry = CollectorRegistry()
    labels = {"model_name": settings.model, "engine": str(settings.dp_rank)}
    registry.register(EngineCollector(engine, labels))
    histograms = RequestHistograms.register(registry, labels)
    engine.on_step = histograms.step
    public = registry
    if settings.metrics == "minimal" or settings.engine_kind == "sglang":
        public = CollectorRegistry()
        if settings.engine_kind == "sglang":
            public.register(SglangCollector(engine, {"model_name": settings.model, "dp_rank": str(settings.dp_rank)}))
        else:
            public.register(EngineCollector(engine, labels, minimal=True))
    return _State(settings, engine, prompts, histograms, registry, public, LoraAdapters(settings.lora_modules))


async def _serve_http(stack: contextlib.AsyncExitStack, state: _State) -> int:
    """Bind the HTTP port (a clean :class:`StartupError` when it cannot); returns the port."""
    settings = state.settings
    runner = OpenAIErrorsRunner(create_app(state), access_log=None)
    await runner.setup()
    stack.push_async_callback(runner.cleanup)
    address = f"{settings.host}:{settings.port}"
    try:
        with listening("the HTTP API", address, "--port (or --host)"):
            await web.TCPSite(runner, settings.host, settings.port).start()
    except socket.gaierror as exc:
        raise StartupError(
            f"cannot listen on {address} for the HTTP API: {exc.strerror}; pass another --host"
        ) from None
    return int(runner.addresses[0][1])


def _connector(settings: SimEngineSettings) -> KVConnector | None:
    """The KV connector of an engine started with --kv-transfer (sim_engine/kv_transfer.py)."""
    if not settings.kv_transfer:
        return None
    return KVConnector(
        settings.kv_transfer_ms_per_1k_tokens,
        settings.kv_transfer_timeout_s,
        settings.timing.speedup,
        settings.kv_transfer_address,
    )


def _shared_compute(settings: SimEngineSettings) -> SharedCompute | None:
    """The compute an engine started with --shared-compute shares (sim_engine/shared_compute.py)."""
    if settings.shared_compute is None:
        return None
    return SharedCompute(settings.shared_compute, settings.shared_cores)


def _event_sink(
    settings: SimEngineSettings, context: zmq.asyncio.Context
) -> KVEventPublisher | TrtllmEventQueue | None:
    """Where the engine's KV events go: TensorRT-LLM's queue (fetched over HTTP), a ZMQ publisher
    speaking vLLM's or SGLang's wire, or nowhere (--events-endpoint none)."""
    if settings.engine_kind == "trtllm":
        return TrtllmEventQueue(settings.num_blocks, settings.buffer_steps)
    if not settings.events_endpoint:
        return None
    return KVEventPublisher(
        context,
        settings.events_endpoint,
        settings.replay_endpoint,
        settings.topic,
        settings.buffer_steps,
        settings.dp_rank,
        settings.events_bind,
        sglang.encode_payload if settings.engine_kind == "sglang" else encode_payload,
    )


@contextlib.asynccontextmanager
async def running_engine(settings: SimEngineSettings) -> AsyncIterator[RunningEngine]:
    """Run an engine in this event loop until the block exits.

    A step that fails (a port in use: :class:`StartupError`) closes every step before it."""
    async with contextlib.AsyncExitStack() as stack:
        context = zmq.asyncio.Context()
        stack.callback(context.destroy, linger=0)
        publisher = _event_sink(settings, context)
        if isinstance(publisher, KVEventPublisher):
            stack.push_async_callback(publisher.close)
            publisher.start()
        prompts = ModelPrompts(settings.tokenizer)
        connector = _connector(settings)
        if connector is not None:
            stack.push_async_callback(connector.close)
        engine = SimEngine(
            settings.num_blocks,
            settings.block_size,
            settings.timing,
            publisher,
            settings.max_model_len,
            prompts.vocab_size,
            faults=EngineFaults(drop_events_every=settings.drop_events_every),
            cpu_blocks=settings.cpu_blocks,
            cpu_load_ms_per_1k_tokens=settings.cpu_load_ms_per_1k_tokens,
            disk_blocks=settings.disk_blocks,
            disk_load_ms_per_1k_tokens=settings.disk_load_ms_per_1k_tokens,
            sliding_window=settings.sliding_window,
            connector=connector,
            compute=_shared_compute(settings),
        )
        stack.push_async_callback(engine.stop)
        engine.start()
        port = await _serve_http(stack, _state(settings, engine, prompts))
        if connector is not None:
            connector.port = port  # what its prefill replies name (remote_port)
            connector.start()
        yield RunningEngine(
            f"http://{settings.host}:{port}",
            publisher.endpoint if publisher else None,
            publisher.replay_endpoint if publisher else None,
            engine,
            publisher,
        )
