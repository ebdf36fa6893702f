"""``GET /dashboard``: a live page over this replica's view of the fleet, and its JSON endpoints.

The page (``router/observe/static/``: HTML, JS and CSS shipped with the package, no build step) fetches
nothing but these endpoints of the router that served it (docs/dashboard.md documents them):

- ``/dashboard/api/fleet``: alive workers per model with KV usage, queue, in-flight load and
  indexed blocks; degraded mode; decisions per second.
- ``/dashboard/api/accounting``: hit rate, predicted vs reported cached tokens and the three-way
  split of lost prefix tokens over the last minutes (:mod:`router.routing.accounting`), per bucket.
- ``/dashboard/api/prefixes``: the most hit prefixes, with how many workers hold them.

They show what ``/metrics`` shows (worker ids, loads, counts; no worker URL, no prompt text; a
prefix is named by a truncated hash); with API keys set they need the key like ``/v1/`` (the page
asks for it).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import fields
from importlib import resources
from typing import TYPE_CHECKING, Any

from kvindex.shared_load import InflightLoad
from router.http.routes import Routes
from router.http.wire import Handler, HttpRequest, Reply
from router.routing.accounting import Bucket, summary

if TYPE_CHECKING:
    from router.state import RouterState

STATIC = {  # file -> content type
    "dashboard.html": "text/html; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
API_PREFIX = "/dashboard/api/"
TOTALS_WAIT_S = 0.25  # how long a fleet answer waits for the shared load before showing this replica's
TOP_PREFIXES = 10
RATE_WINDOW_S = 60.0  # decisions per second: over the last minute
# Cache-Control of the JSON: always fresh. Of the page's files: they only change with the package.
NO_STORE = {"Cache-Control": "no-store"}


def _static(name: str) -> bytes:
    return resources.files("router.observe").joinpath("static", name).read_bytes()


class SharedTotals:
    """The in-flight load every replica has booked per worker, read from Redis for the dashboard.
    A read is never cancelled on the wire (that costs its connection, see router/routing/lookups.py): an
    answer waits for it at most ``TOTALS_WAIT_S``, then shows this replica's own load, and one
    read per model runs at a time, so a slow Redis never piles reads up."""

    def __init__(self) -> None:
        self._reading: dict[str, asyncio.Task[dict[str, InflightLoad]]] = {}

    async def read(self, state: RouterState, model: str) -> tuple[dict[str, InflightLoad], str]:
        """(load per worker id, "fleet" when every replica's load was read, else "replica")."""
        task = self._reading.get(model)
        if task is None or task.done():
            task = asyncio.ensure_future(state.load.shared.totals(model))
            task.add_done_callback(_swallow)
            self._reading[model] = task
        done, _ = await asyncio.wait({task}, timeout=TOTALS_WAIT_S)
        if done and not task.cancelled() and task.exception() is None:
            return task.result(), "fleet"
        return state.load.inflight(model), "replica"


def _swallow(task: asyncio.Future[Any]) -> None:
    """A read whose answer nobody waits for any more: its error is not "never retrieved"."""
    with contextlib.suppress(asyncio.CancelledError, Exception):
        task.exception()


async def fleet_view(state: RouterState, totals: SharedTotals) -> dict[str, Any]:
    fleet = state.fleet
    retained = set(fleet.retained_models())
    models = []
    for model in fleet.models_with_workers():
        loads, scope = await totals.read(state, model)
        workers = []
        for w in fleet.alive(model):
            inflight = loads.get(w.worker_id, InflightLoad())
            engine = w.load
            workers.append(
                {
                    "id": w.worker_id,
                    "role": w.role,  # its part in a prefill/decode split (kvindex/roles.py)
                    "indexed_blocks": w.blocks,
                    "capacity_blocks": engine.capacity_blocks if engine else None,
                    "kv_usage": engine.kv_usage if engine else None,
                    "running": engine.running if engine else None,
                    "waiting": engine.waiting if engine else None,
                    "inflight_requests": inflight.requests,
                    "inflight_prompt_tokens": inflight.prompt_tokens,
                    "inflight_uncached_tokens": inflight.uncached_tokens,
                    "heartbeat_age_ms": w.heartbeat_age_ms,
                    "adapters": list(w.adapters),  # the LoRA adapters its engine serves
                    "tier_blocks": fleet.tier_blocks(model, w.worker_id),  # its CPU, disk, remote tiers' blocks
                }
            )
        groups = [g.text() for g in fleet.kv_groups(model)]  # a hybrid model's KV-cache groups
        models.append(
            {
                "model": model,
                "retained": model in retained,
                "inflight_scope": scope,
                "kv_groups": groups,
                "workers": workers,
            }
        )
    recent, seconds = state.window.total(time.monotonic(), RATE_WINDOW_S)
    age = fleet.view_age_s
    return {
        "replica": state.settings.replica_id,
        "policy": state.settings.policy.value,
        "redis": fleet.last_error is None and fleet.has_view,
        "degraded": state.decider.degraded,
        "worker_view_age_s": None if age is None else round(age, 3),
        "decisions_per_s": round(recent.decisions / seconds, 3) if seconds > 0 else None,
        "degraded_decisions_last_minute": recent.degraded,
        "models": models,
    }


def accounting_view(state: RouterState) -> dict[str, Any]:
    now = time.monotonic()
    window = state.window
    total, seconds = window.total(now)
    return {
        "bucket_s": window.bucket_s,
        "window_s": window.bucket_s * window.buckets,
        "total": summary(total, seconds),
        # per role of the worker each split was charged to (a prefill/decode fleet's: the prefill
        # worker of a split request; an aggregated fleet has only "both")
        "by_role": {role: summary(w.total(now)[0], seconds) for role, w in sorted(window.by_role.items())},
        "series": [{"started_s_ago": ago, **summary(bucket, window.bucket_s)} for ago, bucket in window.series(now)],
    }


def add_dashboard_routes(routes: Routes, state: RouterState) -> None:
    totals = SharedTotals()

    def page(name: str) -> Handler:
        async def serve(_: HttpRequest, reply: Reply) -> None:
            await reply.send_whole(200, {"Content-Type": STATIC[name]}, _static(name))

        return serve

    async def fleet(_: HttpRequest, reply: Reply) -> None:
        await reply.send_json(await fleet_view(state, totals), headers=NO_STORE)

    async def accounting(_: HttpRequest, reply: Reply) -> None:
        await reply.send_json(accounting_view(state), headers=NO_STORE)

    async def prefixes(_: HttpRequest, reply: Reply) -> None:
        top = state.prefixes.top(TOP_PREFIXES, time.monotonic())
        await reply.send_json({"prefixes": top, "tracked": len(state.prefixes)}, headers=NO_STORE)

    routes.get("/dashboard", page("dashboard.html"))
    routes.get("/dashboard/dashboard.js", page("dashboard.js"))
    routes.get("/dashboard/dashboard.css", page("dashboard.css"))
    routes.get(API_PREFIX + "fleet", fleet)
    routes.get(API_PREFIX + "accounting", accounting)
    routes.get(API_PREFIX + "prefixes", prefixes)


# The JSON answers as router/observe/openapi.py documents them.
_NUMBER = {"type": "number", "nullable": True}
_SHARES = {"type": "object", "properties": {r: _NUMBER for r in ("load_tradeoff", "stale_index", "cold")}}
_WINDOW_SUMS = {
    "type": "object",
    "description": "sums over a time span (docs/dashboard.md): tokens, requests, and the rates derived from them",
    "properties": {
        **{item.name: {"type": "integer"} for item in fields(Bucket)},
        "started_s_ago": {"type": "number", "description": "in series: when its bucket started"},
        "hit_rate": _NUMBER,
        "predicted_hit_rate": _NUMBER,
        "lost_share": {**_SHARES, "description": "each reason's lost tokens / cacheable tokens"},
        "decisions_per_s": _NUMBER,
        "regret_share": {
            **_NUMBER,
            "description": "of the requests whose engine reported, those another worker was predicted to serve better",
        },
    },
}
DASHBOARD_SCHEMAS: dict[str, Any] = {
    "DashboardFleet": {
        "type": "object",
        "required": ["replica", "policy", "redis", "degraded", "decisions_per_s", "models"],
        "properties": {
            "replica": {"type": "string"},
            "policy": {"type": "string"},
            "redis": {"type": "boolean"},
            "degraded": {"type": "boolean", "description": "the last decision could not use Redis"},
            "worker_view_age_s": _NUMBER,
            "decisions_per_s": {**_NUMBER, "description": "this replica's, over the last minute"},
            "degraded_decisions_last_minute": {"type": "integer"},
            "models": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "model": {"type": "string"},
                        "retained": {"type": "boolean"},
                        "inflight_scope": {"type": "string", "enum": ["fleet", "replica"]},
                        "workers": {"type": "array", "items": {"type": "object"}},
                    },
                },
            },
        },
    },
    "DashboardAccounting": {
        "type": "object",
        "required": ["bucket_s", "window_s", "total", "series"],
        "properties": {
            "bucket_s": {"type": "number"},
            "window_s": {"type": "number"},
            "total": _WINDOW_SUMS,
            "series": {"type": "array", "items": _WINDOW_SUMS, "description": "one per bucket, oldest first"},
        },
    },
    "DashboardPrefixes": {
        "type": "object",
        "required": ["prefixes", "tracked"],
        "properties": {
            "tracked": {"type": "integer"},
            "prefixes": {"type": "array", "items": {"type": "object"}, "description": "the most hit, first"},
        },
    },
}
