"""The agent's own HTTP endpoints: GET /health (JSON; 200 while the worker is in the index and
its engine answers, 503 otherwise) and GET /metrics (Prometheus text). Each request is one
access-log record (:func:`kvservice.logs.log_request`, as the router and the simulated engine
write them): at DEBUG for these two paths, which scrapers and health checks call every few
seconds and would drown the agent's own INFO lines, at INFO for anything else (a wrong path)."""

from __future__ import annotations

import logging

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kvservice.logs import access_log_middleware
from worker_agent.agent import Agent

log = logging.getLogger(__name__)
QUIET_PATHS = frozenset({"/metrics", "/health"})  # probes and scrapes: logged at DEBUG


def health_body(agent: Agent) -> dict[str, object]:
    gauges = agent.gauges()
    since = agent.watch.seconds_since_message()
    return {
        "status": "engine_down" if not agent.engine_up else ("ok" if gauges.registered else "starting"),
        "worker_id": agent.settings.resolved_worker_id,
        "engine_url": agent.settings.engine_root,
        "engine_kind": agent.pipeline.kind.name,  # how its events and metrics are read
        "block_size": agent.pipeline.block_size,
        "unreproducible_blocks": dict(agent.counters.unreproducible_blocks),
        "registered": gauges.registered,
        "engine_up": gauges.engine_up,
        "last_seq": gauges.last_seq,
        "mirror_blocks": gauges.mirror_blocks,
        "indexed_blocks": gauges.mirror_indexed_blocks,
        "events_endpoint": agent.watch.endpoint,
        "events_silent": gauges.events_silent,
        "seconds_since_event": round(since, 3) if since is not None else None,
    }


def create_app(agent: Agent, registry: CollectorRegistry) -> web.Application:
    async def health(_: web.Request) -> web.Response:
        body = health_body(agent)
        return web.json_response(body, status=200 if body["status"] == "ok" else 503)

    async def metrics(_: web.Request) -> web.Response:
        response = web.Response(body=generate_latest(registry))
        response.content_type = CONTENT_TYPE_LATEST.split(";")[0]
        return response

    app = web.Application(middlewares=[access_log_middleware(log, QUIET_PATHS)])
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app
