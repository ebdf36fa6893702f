"""``kvroute router`` / ``python -m router``: wires settings, clients and the app together."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

from kvindex.keys import KeySchema
from kvindex.redis_index import RedisIndex
from kvindex.redis_routing import RedisRoutingIndex
from kvindex.settings import redact_url
from kvindex.shared_load import SharedLoad
from kvservice.lifecycle import listening, run_service, serve_until_signal
from kvservice.logs import configure_logging
from kvservice.options import Parser, fail_settings
from router.app import count_request, create_routes, edge_settings, new_admission
from router.http.aiohttp_server import AiohttpServer
from router.http.server import HttpServer, ServerRules
from router.observe.metrics import StateCollector, new_metrics
from router.prompts.tokenization import Tokenization
from router.routing.allow import WorkerAllowList
from router.routing.decide import Decider
from router.routing.fleet import Fleet
from router.routing.model_sync import ModelSync
from router.settings import HttpServerKind, RouterSettings, UpstreamClientKind, add_arguments, settings_from_args
from router.shared.replica_load import FLUSH_WINDOW_S, UNCARRIED_FLUSH_WINDOW_S, ReplicaLoad
from router.state import RouterState
from router.upstream.aiohttp_pool import AiohttpPool
from router.upstream.pool import UpstreamPool
from router.workers import run_workers

log = logging.getLogger("router")


@dataclass
class RunningRouter:
    url: str
    state: RouterState


@asynccontextmanager
async def running_router(settings: RouterSettings) -> AsyncIterator[RunningRouter]:
    """Run a router replica in this event loop until the block exits (tests, the demo). Whatever
    was started is closed again, in reverse order, also when a later step fails (a port in use)."""
    async with AsyncExitStack() as stack:
        client = settings.redis.client(
            command_timeouts=False,
            max_connections=settings.redis_pool_size,
            client_name=f"kvroute-router:{settings.replica_id}",
        )
        stack.push_async_callback(client.aclose)
        schema = KeySchema(settings.redis.prefix)
        index = RedisIndex(client, schema)
        stack.push_async_callback(index.scripts.aclose)  # its pipelined connection, after the last flush
        shared = SharedLoad(client, schema, settings.replica_id, index.scripts)
        routing = RedisRoutingIndex(index, shared)  # the router's one port onto Redis (kvindex.routing_index)
        _warn_if_open(settings)
        fleet = Fleet(
            routing, settings.workers_refresh_s, settings.worker_retain_s, WorkerAllowList(settings.worker_allow)
        )
        if not await fleet.try_refresh():
            log.warning(
                "no worker view at start: Redis at %s (%s); retrying in the background",
                redact_url(settings.redis.url),
                fleet.last_error,
            )
        fleet.start()
        stack.push_async_callback(fleet.stop)
        window = FLUSH_WINDOW_S if routing.cancel_safe else UNCARRIED_FLUSH_WINDOW_S
        load = ReplicaLoad(
            shared, settings.lease_ttl_ms, settings.expected_ttl_ms, settings.redis.socket_timeout_s, window
        )
        load.start(fleet.models_with_workers)
        stack.push_async_callback(lambda: load.stop(fleet.models_with_workers()))
        pool_kind = AiohttpPool if settings.upstream_client is UpstreamClientKind.AIOHTTP else UpstreamPool
        upstream = pool_kind.from_settings(settings)
        stack.push_async_callback(upstream.close)
        decider = Decider(
            routing,
            load,
            fleet,
            settings.weights,
            settings.policy,
            settings.redis_timeout_s,
            lookup_slots=settings.lookup_slots,
            backstop_s=settings.redis.socket_timeout_s,
        )
        stack.push_async_callback(decider.lookups.aclose)
        model_sync = ModelSync(
            shared,
            decider.learner_for,
            lambda model: [w.worker_id for w in fleet.alive(model)],
            settings.model_sync_ms / 1000,
            settings.redis.socket_timeout_s,
        )
        if model_sync.status.enabled:  # start from what the other replicas learned, not the priors
            await model_sync.try_sync_all(fleet.models_with_workers())
        model_sync.start(fleet.models_with_workers)
        stack.push_async_callback(lambda: model_sync.stop(fleet.models_with_workers()))
        tokenization = Tokenization(settings.tokenizer_dirs, upstream, settings.max_prompt_tokens)
        state = RouterState(
            settings,
            routing,
            fleet,
            decider,
            load,
            tokenization,
            upstream,
            new_metrics(
                StateCollector(decider.lookups, decider.hasher, tokenization.cache, upstream, model_sync.status)
            ),
            model_sync,
        )
        port = await _serve_http(stack, state)
        yield RunningRouter(f"http://{settings.host}:{port}", state)


async def _serve_http(stack: AsyncExitStack, state: RouterState) -> int:
    """The HTTP API on its port (:mod:`router.http.server`: every endpoint); the port bound."""
    settings = state.settings
    rules = ServerRules(edge_settings(state), settings.header_timeout_s)
    kind = AiohttpServer if settings.http_server is HttpServerKind.AIOHTTP else HttpServer
    server = kind(rules, create_routes(state), new_admission(state), count_request(state))
    with listening("the router's HTTP API", f"{settings.host}:{settings.port}", "--port (or --host)"):
        port = await server.start(settings.host, settings.port, settings.reuse_port)
    stack.push_async_callback(server.shutdown)
    return port


def _warn_if_open(settings: RouterSettings) -> None:
    """Say so, once at start-up, when the API has no key or the workers no allow-list."""
    if not settings.api_keys:
        log.warning(
            "authentication is OFF: no API key configured (--api-key or KVROUTE_API_KEYS), so anyone who can "
            "reach %s:%d can send prompts%s",
            settings.host,
            settings.port,
            " and read /debug/*" if settings.enable_debug else "",
        )
    if not settings.worker_allow:
        log.warning(
            "no --worker-allow list: any worker URL registered in Redis receives prompts; whoever can write "
            "Redis can register one (docs/security.md)"
        )


def _announce(settings: RouterSettings) -> Callable[[RunningRouter], None]:
    def ready(router: RunningRouter) -> None:
        where = redact_url(settings.redis.url)
        log.info("router %s on %s (policy %s, redis %s)", settings.replica_id, router.url, settings.policy.value, where)

    return ready


def build_parser(prog: str = "kvroute router") -> argparse.ArgumentParser:
    parser = Parser(prog=prog, description="A KV-cache-aware OpenAI-compatible router.")
    add_arguments(parser)
    return parser


def run_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        fail_settings(parser, exc, args)
    configure_logging(settings.log)
    if args.lean_front is not None or os.environ.get("KVROUTE_LEAN_FRONT"):
        log.warning(
            "--lean-front/--no-lean-front (KVROUTE_LEAN_FRONT) is deprecated and has no effect: one HTTP server "
            "serves every endpoint (--http-server chooses which); drop it from the command line"
        )
    # Prompts are tokenized a piece at a time (router.prompts.token_memo): a thread pool per call only
    # spun idle threads (sched_yield) between them, on cores that --workers' processes share.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if settings.workers > 1:
        return run_workers(settings, lambda one: _serve(parser.prog, one))
    return _serve(parser.prog, settings)


def _serve(prog: str, settings: RouterSettings) -> int:
    return run_service(prog, lambda: serve_until_signal(running_router(settings), _announce(settings)))


def main(argv: Sequence[str] | None = None, prog: str = "kvroute router") -> int:
    parser = build_parser(prog)
    return run_from_args(parser.parse_args(argv), parser)
