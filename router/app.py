"""The router's endpoints: OpenAI-compatible completions over the decision and the proxy, the
models list, probes, metrics, the OpenAPI document, the debug routes and the dashboard, in one
route table (:mod:`router.http.routes`) that :mod:`router.http.server` serves."""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any
from urllib.parse import parse_qs

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from router.completions import decoded, proxy_completion, route_request
from router.http.edges import Admission, ApiError, EdgeSettings
from router.http.routes import Routes
from router.http.wire import HttpRequest, Reply
from router.observe.dashboard import add_dashboard_routes
from router.observe.openapi import document_bytes
from router.outcomes import split_fields
from router.routing.decision import Decision, predicted_cached_tokens
from router.routing.ttft import TtftLearner
from router.state import RouterState

COMPLETION_ROUTES = {"/v1/completions": False, "/v1/chat/completions": True}  # path: is it a chat


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


def _explain(decision: Decision) -> dict[str, Any]:
    return {
        "model": decision.model,
        "prompt_tokens": decision.prompt_tokens,
        "prompt_blocks": decision.prompt_blocks,
        "block_size": decision.block_size,
        "degraded": decision.degraded,
        "chosen": decision.choice.chosen.worker_id,
        "predicted_cached_tokens": predicted_cached_tokens(decision),
        **split_fields(decision),
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
                "held_blocks": s.candidate.held_blocks,
                "hit_blocks": s.hit_blocks,
                "cached_blocks": s.candidate.cached_blocks,
                "prefill_tokens": s.prefill_tokens,
                "predicted_ttft_ms": round(s.ttft_s * 1000, 3),
            }
            for s in decision.choice.ranked
        ],
    }


def edge_settings(state: RouterState) -> EdgeSettings:
    settings = state.settings
    return EdgeSettings(settings.api_keys, settings.max_body_bytes, settings.body_timeout_s, settings.max_inflight)


def count_request(state: RouterState) -> Callable[[str, int], None]:
    """``count(route, status)``: one request answered, on either front (the metrics)."""
    return lambda route, status: state.metrics.requests.labels(route, str(status)).inc()


def new_admission(state: RouterState) -> Admission:
    """The in-flight limit's count, one per replica process, shared by its HTTP fronts."""
    return Admission(state.settings.max_inflight, state.metrics.admitted.set)


async def _completion(state: RouterState, chat: bool, request: HttpRequest, reply: Reply) -> None:
    await proxy_completion(state, request, reply, chat)


def _query(request: HttpRequest, name: str) -> str | None:
    values = parse_qs(request.query).get(name)
    return values[-1] if values else None


def create_routes(state: RouterState) -> Routes:
    """Every route the router serves, with its handler."""

    async def explain(request: HttpRequest, reply: Reply) -> None:
        body = await decoded(state, request.body)
        decision = await route_request(state, body, chat="messages" in body, dry_run=True)
        await reply.send_json(_explain(decision))

    async def learned(request: HttpRequest, reply: Reply) -> None:
        await reply.send_json(_learned(state, _query(request, "model")))

    async def models(_: HttpRequest, reply: Reply) -> None:
        data: list[dict[str, Any]] = []
        for model in state.fleet.models_with_workers():
            data.append({"id": model, "object": "model", "owned_by": "kvroute"})
            # LoRA adapters as vLLM lists them: each under its own name, with its base as parent
            adapters = state.fleet.adapters(model)
            data += [{"id": a, "object": "model", "owned_by": "kvroute", "parent": model} for a in adapters]
        await reply.send_json({"object": "list", "data": data})

    async def health(_: HttpRequest, reply: Reply) -> None:
        await reply.send_json({"status": "ok", "replica": state.settings.replica_id})

    async def ready(_: HttpRequest, reply: Reply) -> None:
        body, status = _readiness(state)
        await reply.send_json(body, status)

    async def openapi(_: HttpRequest, reply: Reply) -> None:
        await reply.send_whole(200, {"Content-Type": "application/json"}, document_bytes())

    async def metrics(_: HttpRequest, reply: Reply) -> None:
        state.metrics.alive_workers.clear()  # read at scrape time (the fleet refreshes every second)
        for model in state.fleet.known_models():
            state.metrics.alive_workers.labels(model).set(len(state.fleet.alive(model)))
        for model, learner in state.decider.learners.items():
            state.metrics.queue_weight.labels(model).set(learner.model.queue_weight)
        recent = state.window.total(time.monotonic())[0]
        state.metrics.regret_ratio.set(recent.regretted / recent.reported_requests if recent.reported_requests else 0)
        await reply.send_whole(200, {"Content-Type": CONTENT_TYPE_LATEST}, generate_latest(state.metrics.registry))

    routes = Routes()
    for path, chat in COMPLETION_ROUTES.items():
        routes.post(path, partial(_completion, state, chat))
    if state.settings.enable_debug:  # it shows worker URLs and what the index holds: opt-in
        routes.post("/debug/route", explain)
        routes.get("/debug/model", learned)
    routes.get("/v1/models", models)
    routes.get("/health", health)
    routes.get("/ready", ready)
    routes.get("/metrics", metrics)
    routes.get("/openapi.json", openapi)
    add_dashboard_routes(routes, state)
    return routes


def _readiness(state: RouterState) -> tuple[dict[str, Any], int]:
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
    return body, 200 if models else 503
