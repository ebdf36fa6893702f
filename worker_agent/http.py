"""The agent's own HTTP endpoints: GET /health (JSON; 200 while the worker is in the index,
503 otherwise) and GET /metrics (Prometheus text)."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from worker_agent.agent import Agent


def create_app(agent: Agent, registry: CollectorRegistry) -> web.Application:
    async def health(_: web.Request) -> web.Response:
        gauges = agent.gauges()
        body = {
            "status": "ok" if gauges.registered else ("engine_down" if not agent.engine_up else "starting"),
            "worker_id": agent.settings.resolved_worker_id,
            "engine_url": agent.settings.engine_root,
            "registered": gauges.registered,
            "engine_up": gauges.engine_up,
            "last_seq": gauges.last_seq,
            "mirror_blocks": gauges.mirror_blocks,
            "indexed_blocks": gauges.mirror_indexed_blocks,
        }
        return web.json_response(body, status=200 if gauges.registered else 503)

    async def metrics(_: web.Request) -> web.Response:
        response = web.Response(body=generate_latest(registry))
        response.content_type = CONTENT_TYPE_LATEST.split(";")[0]
        return response

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app
