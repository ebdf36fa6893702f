"""The router's HTTP application: OpenAI-compatible endpoints over the decision and the proxy."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvindex.redis_index import RedisIndex
from router.accounting import RollingWindow, SharedPrefixes, Split
from router.body import TOO_DEEP, BodyError, decode_body
from router.booking import Booking
from router.dashboard import add_dashboard_routes
from router.decide import Decider, Decision, NoWorkers
from router.fleet import Fleet
from router.load import ReplicaLoad
from router.metrics import RouterMetrics
from router.middleware import LOG_FIELDS, REQUEST_ID, ApiError, EdgeSettings, edge_middleware
from router.model_sync import ModelSync
from router.openapi import document_bytes
from router.prompts import BadPrompt, PromptTooLong, Tokenization
from router.proxy import UpstreamFailed, forward
from router.scoring import Candidate
from router.settings import RouterSettings
from router.ttft import TtftLearner
from router.upstream import UpstreamPool

APP_KEY: web.AppKey[RouterState] = web.AppKey("router_state")
log = logging.getLogger(__name__)


@dataclass
class RouterState:
    settings: RouterSettings
    index: RedisIndex
    fleet: Fleet
    decider: Decider
    load: ReplicaLoad
    tokenization: Tokenization
    upstream: UpstreamPool
    metrics: RouterMetrics
    model_sync: ModelSync
    window: RollingWindow = field(default_factory=RollingWindow)  # the dashboard's last minutes
    prefixes: SharedPrefixes = field(default_factory=SharedPrefixes)  # the dashboard's shared prefixes


async def _json(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    try:
        body = await decode_body(raw, request.app[APP_KEY].settings.max_prompt_tokens)
    except BodyError as exc:
        raise ApiError(exc.status, str(exc)) from None
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' must be a non-empty string")
    return body


async def _decide(state: RouterState, body: dict[str, Any], chat: bool, dry_run: bool = False) -> Decision:
    """The decision for a request; ``dry_run`` (/debug/route) changes no routing state and no metric."""
    model = body["model"]
    workers = state.fleet.alive(model)
    if not workers:
        raise _no_worker_error(state, model)
    tokens: Sequence[int]
    try:
        if chat:
            tokens = await state.tokenization.chat(model, body, workers[0].url)
        else:
            tokens = await state.tokenization.completion(model, body, workers[0].url)
    except PromptTooLong as exc:
        raise ApiError(413, str(exc)) from None
    except BadPrompt as exc:
        raise ApiError(400, str(exc)) from None
    except RecursionError:
        raise ApiError(400, TOO_DEEP) from None
    except (aiohttp.ClientError, TimeoutError) as exc:
        # The detail names the worker's address: the log's, not the client's.
        log.warning("tokenizing through worker %s failed: %s", workers[0].worker_id, exc)
        raise ApiError(502, "could not tokenize the prompt through a worker", "upstream_error") from None
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ApiError(400, "'cache_salt' must be a non-empty string")
    try:
        decision = await state.decider.decide(model, tokens, salt, dry_run)
    except NoWorkers as exc:
        raise ApiError(503, str(exc), "service_unavailable") from None
    if dry_run:
        return decision
    state.window.note_decision(time.monotonic(), decision.degraded)
    state.metrics.decision_seconds.observe(decision.seconds)
    state.metrics.degraded_mode.set(1 if state.decider.degraded else 0)
    if decision.degraded:
        state.metrics.degraded.inc()
        state.metrics.degraded_causes.labels(decision.degraded_cause or "error").inc()
    return decision


def _learned(state: RouterState, model: str | None) -> dict[str, Any]:
    """``GET /debug/model``: what was learned of ``model`` (default the first served)."""
    served = sorted(set(state.fleet.models_with_workers()) | set(state.decider.learners))
    if model is not None and model not in served:
        known = ", ".join(served) or "none"
        raise ApiError(404, f"nothing is learned of model {model!r}: models are {known}", "not_found_error")
    model = model if model is not None else next(iter(served), None)
    learner = state.decider.learner_for(model) if model is not None else TtftLearner()
    shared = state.model_sync.status.of(model) if model is not None else {"enabled": state.model_sync.status.enabled}
    return {"model": model, "models": served, **learner.snapshot(), "shared": shared}


def _no_worker_error(state: RouterState, model: str) -> ApiError:
    """404 only when the index says the model does not exist; 503 when the router cannot know."""
    fleet = state.fleet
    if not fleet.has_view:
        # Where Redis is and why it failed are in the log (at start-up); not told to clients.
        message = "the router has no view of the workers yet: the index's Redis is unreachable"
        return ApiError(503, message, "service_unavailable")
    if fleet.known(model):
        return ApiError(503, f"no alive worker serves model {model!r}", "service_unavailable")
    served = ", ".join(fleet.models_with_workers()) or "none"
    return ApiError(404, f"The model `{model}` does not exist. Models served: {served}.", "not_found_error")


def _explain(decision: Decision) -> dict[str, Any]:
    return {
        "model": decision.model,
        "prompt_tokens": decision.prompt_tokens,
        "prompt_blocks": decision.prompt_blocks,
        "block_size": decision.block_size,
        "degraded": decision.degraded,
        "chosen": decision.choice.chosen.worker_id,
        "predicted_cached_tokens": decision.predicted_cached_tokens(),
        **_split_fields(decision),
        "workers": [
            {
                "id": s.candidate.worker_id,
                "url": s.candidate.url,
                "matched_blocks": s.candidate.matched_blocks,
                "load": {
                    "inflight_requests": s.candidate.inflight.requests,
                    "inflight_prompt_tokens": s.candidate.inflight.prompt_tokens,
                    "inflight_uncached_tokens": s.candidate.inflight.uncached_tokens,
                    "engine": vars(s.candidate.engine) if s.candidate.engine else None,
                },
                "cost": round(s.cost, 6),
                "busy": s.busy,
                "pending_blocks": s.candidate.pending_blocks,
                "cached_blocks": s.candidate.cached_blocks,
                "prefill_tokens": s.prefill_tokens,
                "predicted_ttft_ms": round(s.ttft_s * 1000, 3),
            }
            for s in decision.choice.ranked
        ],
    }


def _reported_cached(usage: dict | None) -> int | None:
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    return cached if isinstance(cached, int) and not isinstance(cached, bool) else None


def _split_fields(decision: Decision, candidate: Candidate | None = None, reported: int | None = None) -> dict:
    """The accounting's fields of the access log and /debug/route (None: unknown, for a degraded decision)."""
    return _log_fields(decision.split(candidate, reported))


def _log_fields(found: Split | None) -> dict:
    if found is None:
        return dict.fromkeys(("best_match_tokens", "lost_load_tokens", "lost_stale_tokens", "cold_tokens"))
    return found.log_fields()


def _account(state: RouterState, decision: Decision, found: Split | None) -> None:
    """A proxied request's decision quality (``found``: its split, once computed for the log too):
    the metrics, the dashboard's window and prefixes."""
    if found is None:  # degraded: no match was read; counted by degraded_decisions_total
        return
    now = time.monotonic()
    state.window.note_split(now, found)
    for reason, tokens in found.lost().items():
        if tokens:
            state.metrics.lost_prefix_tokens.labels(reason).inc(tokens)
    state.metrics.cacheable_tokens.labels(decision.model).inc(found.cacheable)
    state.metrics.best_match_tokens.labels(decision.model).inc(found.best_match)
    if (prefix := decision.shared_prefix()) is not None:
        state.prefixes.note(decision.model, *prefix, now=now)


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
    state.decider.learner_for(model).note_usage(int(usage.get("prompt_tokens") or 0), int(cached))
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
    policy = state.settings.policy.value if not decision.degraded else "degraded"

    def headers(candidate: Candidate) -> dict[str, str]:
        if not state.settings.routing_headers:
            return {"x-request-id": request[REQUEST_ID]}
        return {
            "x-kvroute-worker": candidate.worker_id,
            "x-kvroute-cached-tokens": str(decision.predicted_cached_tokens(candidate)),
            "x-request-id": request[REQUEST_ID],
        }

    def failed(candidate: Candidate, why: BaseException | int) -> None:
        state.metrics.upstream_errors.labels(candidate.worker_id).inc()
        log.warning("request %s: worker %s failed: %r", request[REQUEST_ID], candidate.worker_id, why)
        if not isinstance(why, int):
            # Unreachable: not offered until a refresh lists it again. A 5xx (or a redirect) is
            # this request's failure, not the worker's: it stays a candidate.
            state.fleet.drop(decision.model, candidate.worker_id)

    state.metrics.inflight.inc()
    try:
        streamed = body.get("stream") is True
        with Booking(decision, state.load, state.decider.learner_for(decision.model), streamed) as booking:
            forwarded = await forward(
                request, state.upstream, request.path, raw, decision.candidates, headers, booking, failed
            )
    except UpstreamFailed as exc:
        raise ApiError(502, str(exc), "upstream_error") from None
    finally:
        state.metrics.inflight.dec()
    if forwarded.retried:
        state.metrics.retries.inc()
    state.metrics.decisions.labels(decision.model, forwarded.candidate.worker_id, policy).inc()
    _record_usage(state, decision, forwarded.candidate, forwarded.usage)
    reported = _reported_cached(forwarded.usage)
    found = decision.split(forwarded.candidate, reported)
    _account(state, decision, found)
    request[LOG_FIELDS] = {
        "model": decision.model,
        "worker": forwarded.candidate.worker_id,
        "prompt_tokens": decision.prompt_tokens,
        "degraded": decision.degraded,
        "predicted_cached_tokens": decision.predicted_cached_tokens(forwarded.candidate),
        "cached_tokens": reported,
        **_log_fields(found),
        "decision_ms": round(decision.seconds * 1000, 3),
        "retried": forwarded.retried,
    }
    return forwarded.response


def create_app(state: RouterState) -> web.Application:
    async def completions(request: web.Request) -> web.StreamResponse:
        return await _proxy(request, chat=False)

    async def chat(request: web.Request) -> web.StreamResponse:
        return await _proxy(request, chat=True)

    async def explain(request: web.Request) -> web.Response:
        body = await _json(request)
        decision = await _decide(state, body, chat="messages" in body, dry_run=True)
        return web.json_response(_explain(decision))

    async def learned(request: web.Request) -> web.Response:
        return web.json_response(_learned(state, request.query.get("model")))

    async def models(_: web.Request) -> web.Response:
        data = [{"id": m, "object": "model", "owned_by": "kvroute"} for m in state.fleet.models_with_workers()]
        return web.json_response({"object": "list", "data": data})

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "replica": state.settings.replica_id})

    async def ready(_: web.Request) -> web.Response:
        return _readiness(state)

    async def openapi(_: web.Request) -> web.Response:
        return web.Response(body=document_bytes(), content_type="application/json")

    async def metrics(_: web.Request) -> web.Response:
        state.metrics.alive_workers.clear()  # read at scrape time (the fleet refreshes every second)
        for model in state.fleet.known_models():
            state.metrics.alive_workers.labels(model).set(len(state.fleet.alive(model)))
        response = web.Response(body=generate_latest(state.metrics.registry))
        response.content_type = CONTENT_TYPE_LATEST.split(";")[0]
        return response

    settings = state.settings
    edges = EdgeSettings(settings.api_keys, settings.max_body_bytes, settings.body_timeout_s, settings.max_inflight)
    middleware = edge_middleware(
        edges,
        lambda route, status: state.metrics.requests.labels(route, str(status)).inc(),
        state.metrics.admitted.set,
    )
    app = web.Application(middlewares=[middleware], client_max_size=state.settings.max_body_bytes)
    app[APP_KEY] = state
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)
    if settings.enable_debug:  # it shows worker URLs and what the index holds: opt-in
        app.router.add_post("/debug/route", explain)
        app.router.add_get("/debug/model", learned)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
    add_dashboard_routes(app, state)
    return app


def _readiness(state: RouterState) -> web.Response:
    """Ready = this replica can route: it has a view of alive workers, from Redis now or the last
    one it read (degraded routing carries the traffic while Redis is away, so a probe must not
    drain every replica exactly then). ``redis`` says whether the last refresh reached Redis;
    ``retained_models`` are served from their last known workers while Redis lists none."""
    fleet = state.fleet
    models = fleet.models_with_workers()
    redis_ok = fleet.last_error is None and fleet.has_view
    age = fleet.view_age_s
    retained = fleet.retained_models()
    body = {
        "ready": bool(models),
        "redis": redis_ok,
        "workers": bool(models),
        "models": models,
        "retained_models": retained,
        "degraded": state.decider.degraded or not redis_ok or bool(retained),
        "worker_view_age_s": None if age is None else round(age, 3),
    }
    if not fleet.has_view:
        why = (fleet.last_error or "no answer yet").split(":", 1)[0]  # the kind: the message names Redis's address
        body["reason"] = f"no worker view yet: Redis unreachable ({why})"
    elif not models:
        body["reason"] = "no alive worker is registered in the index"
    return web.json_response(body, status=200 if models else 503)
