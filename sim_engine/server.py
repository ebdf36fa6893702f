"""The simulated engine's HTTP server: vLLM's OpenAI-compatible API over :class:`SimEngine`.

Start it in-process with :func:`running_engine` (tests, the demo, benchmarks) or as a process
with ``kvroute sim-engine``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import zmq.asyncio
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest

from router.tokenizer import ModelPrompts
from sim_engine import api
from sim_engine.engine import RequestRejected, SimEngine, SimRequest
from sim_engine.kv_events import KVEventPublisher
from sim_engine.metrics import EngineCollector
from sim_engine.settings import SimEngineSettings

MAX_BODY_BYTES = 32 * 1024 * 1024


@dataclass
class _State:
    settings: SimEngineSettings
    engine: SimEngine
    prompts: ModelPrompts
    ttft: Histogram
    e2e: Histogram
    registry: CollectorRegistry


def _error(exc: api.ApiError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status)


async def _json_body(request: web.Request) -> Any:
    try:
        return json.loads(await request.read())
    except ValueError as exc:
        raise api.ApiError(400, f"the request body is not valid JSON: {exc}") from None


def create_app(state: _State) -> web.Application:
    model = state.settings.model

    async def health(_: web.Request) -> web.Response:
        return web.Response(status=200)

    async def models(_: web.Request) -> web.Response:
        created = int(time.time())
        entry = {"id": model, "object": "model", "created": created, "owned_by": "vllm", "root": model,
                 "parent": None, "max_model_len": state.settings.max_model_len}  # fmt: skip
        return web.json_response({"object": "list", "data": [entry]})

    async def tokenize(request: web.Request) -> web.Response:
        try:
            body = await _json_body(request)
            return web.json_response(api.tokenize(body, model, state.prompts, state.settings.max_model_len))
        except api.ApiError as exc:
            return _error(exc)

    async def reset(_: web.Request) -> web.Response:
        if state.engine.reset_prefix_cache():
            return web.Response(status=200)
        return web.json_response(
            api.ApiError(400, "requests are running: cannot reset the prefix cache").body(), status=400
        )

    async def cached_blocks(_: web.Request) -> web.Response:
        """The engine hashes in the prefix cache (for duplication measurements across engines)."""
        return web.json_response({"cached_blocks": [f"{h:016x}" for h in state.engine.pool.cached_hashes()]})

    async def metrics(_: web.Request) -> web.Response:
        response = web.Response(body=generate_latest(state.registry))
        response.content_type = CONTENT_TYPE_LATEST.split(";")[0]
        return response

    async def completions(request: web.Request) -> web.StreamResponse:
        return await _generate(request, state, chat=False)

    async def chat(request: web.Request) -> web.StreamResponse:
        return await _generate(request, state, chat=True)

    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/reset_prefix_cache", reset)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/debug/cache", cached_blocks)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)
    return app


async def _generate(request: web.Request, state: _State, chat: bool) -> web.StreamResponse:
    try:
        body = await _json_body(request)
        parse = api.parse_chat if chat else api.parse_completion
        generation = parse(body, state.settings.model, state.prompts)
        request_id = api.new_id(chat)
        submitted = [
            state.engine.submit(SimRequest(f"{request_id}-{i}", prompt, generation.max_tokens, generation.cache_salt))
            for i, prompt in enumerate(generation.prompts)
        ]
    except api.ApiError as exc:
        return _error(exc)
    except RequestRejected as exc:
        return _error(api.ApiError(400, str(exc)))
    try:
        if generation.stream:
            return await _stream(request, state, generation, request_id, submitted)
        texts = await asyncio.gather(*(_collect(state, r) for r in submitted))
        ids = [(r.prompt, r.output) for r in submitted] if generation.return_token_ids else None
        body = api.completion(request_id, state.settings.model, chat, list(texts), _usage(submitted), ids)
        return web.json_response(body)
    finally:
        for sim_request in submitted:
            if not sim_request.finished.is_set():
                state.engine.abort(sim_request)  # the client went away


def _usage(requests: list[SimRequest]) -> dict[str, Any]:
    return api.usage(
        sum(len(r.prompt) for r in requests), sum(len(r.output) for r in requests),
        sum(r.cached_tokens or 0 for r in requests),
    )  # fmt: skip


async def _collect(state: _State, request: SimRequest) -> str:
    async for _ in _tokens(state, request):
        pass
    return state.prompts.decode(request.output)


async def _tokens(state: _State, request: SimRequest) -> AsyncIterator[int]:
    while (token := await request.tokens.get()) is not None:
        if len(request.output) == 1 and request.first_token_at is not None:
            state.ttft.observe(request.first_token_at - request.arrived)
        yield token
    state.e2e.observe(time.monotonic() - request.arrived)


async def _stream(
    request: web.Request, state: _State, generation: api.Generation, request_id: str, submitted: list[SimRequest]
) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    queue: asyncio.Queue[tuple[int, str, str | None]] = asyncio.Queue()

    async def pump(index: int, sim_request: SimRequest) -> None:
        sent = ""
        first = True
        async for _ in _tokens(state, sim_request):
            text = state.prompts.decode(sim_request.output)
            if text.startswith(sent) and not text.endswith("\ufffd"):  # hold back half a character
                await queue.put(
                    (index, text[len(sent) :], None if len(sim_request.output) < sim_request.max_tokens else "length")
                )
                sent, first = text, False
        if first or len(sent) < len(state.prompts.decode(sim_request.output)):
            await queue.put((index, state.prompts.decode(sim_request.output)[len(sent) :], "length"))

    model, chat = state.settings.model, generation.chat
    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(submitted)]
    started = dict.fromkeys(range(len(submitted)), False)
    try:
        finished = 0
        while finished < len(submitted):
            index, text, finish = await queue.get()
            if chat and not started[index]:  # vLLM opens each chat choice with the role alone
                payload = api.chunk(request_id, model, chat, index, "", None, first=True)
                await response.write(f"data: {json.dumps(payload)}\n\n".encode())
            started[index] = True
            payload = api.chunk(request_id, model, chat, index, text, finish)
            await response.write(f"data: {json.dumps(payload)}\n\n".encode())
            finished += finish is not None
        if generation.include_usage:
            payload = api.usage_chunk(request_id, model, chat, _usage(submitted))
            await response.write(f"data: {json.dumps(payload)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    finally:
        for task in tasks:
            task.cancel()
    return response


@dataclass
class RunningEngine:
    """A started engine: where to reach it, and its parts (for tests and the demo)."""

    url: str
    events_endpoint: str | None
    replay_endpoint: str | None
    engine: SimEngine
    publisher: KVEventPublisher | None


@contextlib.asynccontextmanager
async def running_engine(settings: SimEngineSettings) -> AsyncIterator[RunningEngine]:
    """Run an engine in this event loop until the block exits."""
    context = zmq.asyncio.Context()
    publisher = None
    if settings.events_endpoint:
        publisher = KVEventPublisher(context, settings.events_endpoint, settings.replay_endpoint, settings.topic,
                                     settings.buffer_steps, settings.dp_rank).start()  # fmt: skip
    prompts = ModelPrompts(settings.tokenizer)
    engine = SimEngine(settings.num_blocks, settings.block_size, settings.timing, publisher,
                       settings.max_model_len, prompts.vocab_size).start()  # fmt: skip
    registry = CollectorRegistry()
    labels = {"model_name": settings.model, "engine": str(settings.dp_rank)}
    registry.register(EngineCollector(engine, labels))
    ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", list(labels), registry=registry)
    e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency", list(labels), registry=registry)
    state = _State(settings, engine, prompts, ttft.labels(**labels), e2e.labels(**labels), registry)  # type: ignore[arg-type]
    runner = web.AppRunner(create_app(state), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port)
    await site.start()
    port = runner.addresses[0][1] if settings.port == 0 else settings.port
    try:
        yield RunningEngine(f"http://{settings.host}:{port}", publisher.endpoint if publisher else None,
                            publisher.replay_endpoint if publisher else None, engine, publisher)  # fmt: skip
    finally:
        await runner.cleanup()
        await engine.stop()
        if publisher is not None:
            await publisher.close()
        context.destroy(linger=0)
