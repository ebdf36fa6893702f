"""The router's HTTP application: OpenAI-compatible endpoints over the decision and the proxy."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.exceptions import RedisError

from kvindex.redis_index import RedisIndex
from router.shared_load import InflightLoad
from router.decide import Decider, Decision, NoWorkers
from router.fleet import Fleet
from router.load import ReplicaLoad
from router.metrics import RouterMetrics
from router.prompts import BadPrompt, Tokenization
from router.proxy import REQUEST_ID, UpstreamFailed, forward
from router.scoring import Candidate
from router.settings import RouterSettings

access_log = logging.getLogger("router.access")
APP_KEY: web.AppKey[RouterState] = web.AppKey("router_state")
_DECODER = msgspec.json.Decoder()
LOG_FIELDS: web.RequestKey[dict[str, Any]] = web.RequestKey("log_fields", dict)


@dataclass
class RouterState:
    settings: RouterSettings
    index: RedisIndex
    fleet: Fleet
    decider: Decider
    load: ReplicaLoad
    tokenization: Tokenization
    session: aiohttp.ClientSession
    metrics: RouterMetrics


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def error_response(status: int, message: str, kind: str) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.json_response(body, status=status)


@web.middleware
async def errors_and_auth(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    state = request.app[APP_KEY]
    request[REQUEST_ID] = request.headers.get("X-Request-Id") or uuid.uuid4().hex
    started = time.perf_counter()
    status = 500
    try:
        if state.settings.api_keys and (request.path.startswith("/v1/") or request.path.startswith("/debug/")):
            auth = request.headers.get("Authorization", "")
            if not auth.startswith("Bearer ") or auth[7:] not in state.settings.api_keys:
                raise ApiError(401, "a valid API key is required (Authorization: Bearer <key>)", "authentication_error")
        response = await handler(request)
        status = response.status
        return response
    except ApiError as exc:
        status = exc.status
        return error_response(exc.status, exc.message, exc.kind)
    except web.HTTPRequestEntityTooLarge:
        status = 413
        return error_response(
            413, f"the request body exceeds {state.settings.max_body_bytes} bytes", "invalid_request_error"
        )
    finally:
        state.metrics.requests.labels(request.path, str(status)).inc()
        if access_log.isEnabledFor(logging.INFO):
            fields = {"request_id": request[REQUEST_ID], "method": request.method, "path": request.path,
                      "status": status, "ms": round(1000 * (time.perf_counter() - started), 2),
                      **request.get(LOG_FIELDS, {})}  # fmt: skip
            access_log.info(json.dumps(fields))


async def _json(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    try:
        body = _DECODER.decode(raw)  # msgspec: 2-3x json's speed on long token-id arrays
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' must be a non-empty string")
    return body


async def _decide(state: RouterState, body: dict[str, Any], chat: bool) -> Decision:
    model = body["model"]
    workers = state.fleet.alive(model)
    if not workers:
        if not state.fleet.known(model):
            raise ApiError(404, f"The model `{model}` does not exist.", "not_found_error")
        raise ApiError(503, f"no alive worker serves model {model!r}", "service_unavailable")
    tokens: Sequence[int]
    try:
        if chat:
            tokens = await state.tokenization.chat(model, body, workers[0].url)
        else:
            tokens = await state.tokenization.completion(model, body, workers[0].url)
    except BadPrompt as exc:
        raise ApiError(400, str(exc)) from None
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise ApiError(502, f"could not tokenize through a worker: {exc}", "upstream_error") from None
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ApiError(400, "'cache_salt' must be a non-empty string")
    try:
        decision = await state.decider.decide(model, tokens, salt)
    except NoWorkers as exc:
        raise ApiError(503, str(exc), "service_unavailable") from None
    state.metrics.decision_seconds.observe(decision.seconds)
    if decision.degraded:
        state.metrics.degraded.inc()
    return decision


def _explain(decision: Decision) -> dict[str, Any]:
    return {
        "model": decision.model,
        "prompt_tokens": decision.prompt_tokens,
        "prompt_blocks": decision.prompt_blocks,
        "block_size": decision.block_size,
        "degraded": decision.degraded,
        "chosen": decision.choice.chosen.worker_id,
        "predicted_cached_tokens": decision.predicted_cached_tokens(),
        "workers": [
            {"id": s.candidate.worker_id, "url": s.candidate.url, "matched_blocks": s.candidate.matched_blocks,
             "load": {"inflight_requests": s.candidate.inflight.requests,
                      "inflight_prompt_tokens": s.candidate.inflight.prompt_tokens,
                      "inflight_uncached_tokens": s.candidate.inflight.uncached_tokens,
                      "engine": vars(s.candidate.engine) if s.candidate.engine else None},
             "cost": round(s.cost, 3), "busy": s.busy}
            for s in decision.choice.ranked
        ],
    }  # fmt: skip


def _reported_cached(usage: dict | None) -> int | None:
    return ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")


def _record_usage(state: RouterState, decision: Decision, candidate: Candidate, usage: dict | None) -> None:
    if not usage:
        return
    details = usage.get("prompt_tokens_details") or {}
    model = decision.model
    state.metrics.prompt_tokens.labels(model).inc(int(usage.get("prompt_tokens") or 0))
    cached = details.get("cached_tokens")
    if cached is None:
        return
    predicted = decision.predicted_cached_tokens(candidate)
    state.metrics.cached_tokens.labels(model).inc(int(cached))
    state.metrics.predicted_cached_tokens.labels(model).inc(predicted)
    outcome = "exact" if predicted == cached else ("over" if predicted > cached else "under")
    state.metrics.predictions.labels(model, outcome).inc()
    state.metrics.prediction_error_tokens.observe(abs(predicted - int(cached)))


async def _proxy(request: web.Request, chat: bool) -> web.StreamResponse:
    state = request.app[APP_KEY]
    raw = await request.read()
    body = await _json(request)
    decision = await _decide(state, body, chat)
    ranked = [s.candidate for s in decision.choice.ranked]
    policy = state.settings.policy.value if not decision.degraded else "degraded"

    def headers(candidate: Candidate) -> dict[str, str]:
        return {"x-kvroute-worker": candidate.worker_id,
                "x-kvroute-cached-tokens": str(decision.predicted_cached_tokens(candidate)),
                "x-request-id": request[REQUEST_ID]}  # fmt: skip

    booked: dict[str, Any] = {}

    async def attempt(candidate: Candidate) -> None:
        load, expected = state.decider.booking(decision, candidate)
        state.load.book(decision.model, candidate.worker_id, load, expected)
        booked[candidate.worker_id] = load

    async def release(candidate: Candidate) -> None:
        load = booked.pop(candidate.worker_id, None)
        if load is not None:
            state.load.release(decision.model, candidate.worker_id, load)

    def prefilled(candidate: Candidate) -> None:
        # Its first token is out: its prefill no longer queues ahead of others on that worker.
        load = booked.get(candidate.worker_id)
        if load is not None and load.uncached_tokens:
            done = InflightLoad(0, 0, load.uncached_tokens)
            state.load.release(decision.model, candidate.worker_id, done)
            booked[candidate.worker_id] = load + (-done)

    async def failed(candidate: Candidate, why: BaseException | int) -> None:
        state.metrics.upstream_errors.labels(candidate.worker_id).inc()
        state.fleet.drop(decision.model, candidate.worker_id)
        await release(candidate)

    state.metrics.inflight.inc()
    try:
        forwarded = await forward(request, state.session, request.path, raw, ranked, headers, attempt, failed,
                                  prefilled)  # fmt: skip
    except UpstreamFailed as exc:
        raise ApiError(502, str(exc), "upstream_error") from None
    finally:
        state.metrics.inflight.dec()
        for candidate in ranked[:2]:
            await release(candidate)
    if forwarded.retried:
        state.metrics.retries.inc()
    state.metrics.decisions.labels(decision.model, forwarded.candidate.worker_id, policy).inc()
    _record_usage(state, decision, forwarded.candidate, forwarded.usage)
    request[LOG_FIELDS] = {"model": decision.model, "worker": forwarded.candidate.worker_id,
                      "prompt_tokens": decision.prompt_tokens, "degraded": decision.degraded,
                      "predicted_cached_tokens": decision.predicted_cached_tokens(forwarded.candidate),
                      "cached_tokens": _reported_cached(forwarded.usage),
                      "decision_ms": round(decision.seconds * 1000, 3), "retried": forwarded.retried}  # fmt: skip
    return forwarded.response


def create_app(state: RouterState) -> web.Application:
    async def completions(request: web.Request) -> web.StreamResponse:
        return await _proxy(request, chat=False)

    async def chat(request: web.Request) -> web.StreamResponse:
        return await _proxy(request, chat=True)

    async def explain(request: web.Request) -> web.Response:
        body = await _json(request)
        decision = await _decide(state, body, chat="messages" in body)
        return web.json_response(_explain(decision))

    async def models(_: web.Request) -> web.Response:
        data = [{"id": m, "object": "model", "owned_by": "kvroute"} for m in state.fleet.models_with_workers()]
        return web.json_response({"object": "list", "data": data})

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "replica": state.settings.replica_id})

    async def ready(_: web.Request) -> web.Response:
        try:
            async with asyncio.timeout(1.0):
                await state.index.models()
            redis_ok = True
        except (RedisError, OSError, TimeoutError):
            redis_ok = False
        has_workers = bool(state.fleet.models_with_workers())
        body = {"redis": redis_ok, "workers": has_workers}
        return web.json_response(body, status=200 if redis_ok and has_workers else 503)

    async def metrics(_: web.Request) -> web.Response:
        response = web.Response(body=generate_latest(state.metrics.registry))
        response.content_type = CONTENT_TYPE_LATEST.split(";")[0]
        return response

    app = web.Application(middlewares=[errors_and_auth], client_max_size=state.settings.max_body_bytes)
    app[APP_KEY] = state
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/debug/route", explain)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    return app
