"""``kvroute agent`` / ``python -m worker_agent``: wires settings, clients and the agent together.

Start-up is one :class:`contextlib.AsyncExitStack`: every resource is registered for closing as
soon as it exists, so a step that fails (a port already in use) closes everything started
before it, in reverse order. Such a failure is a :class:`kvservice.lifecycle.StartupError`:
one line on stderr and exit status 2 (:func:`kvservice.lifecycle.run_service`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import sys
from collections.abc import Sequence

import aiohttp
import zmq
import zmq.asyncio
from aiohttp import web

from kvindex.keys import KeySchema
from kvindex.redis_index import RedisIndex
from kvindex.settings import redact_url
from kvservice.http_runner import OpenAIErrorsRunner
from kvservice.lifecycle import EXIT_BAD_SETTINGS, listening, on_signals, run_service
from kvservice.logs import configure_logging
from kvservice.options import Parser, naming_the_variable
from worker_agent.agent import Agent
from worker_agent.engine import EngineClient
from worker_agent.events import subscribe
from worker_agent.http import create_app
from worker_agent.metrics import AgentCollector, AgentCounters, new_registry
from worker_agent.replay import ReplayClient
from worker_agent.settings import AgentSettings, add_arguments, settings_from_args

log = logging.getLogger("worker_agent")


def build_parser(prog: str = "kvroute agent") -> argparse.ArgumentParser:
    parser = Parser(
        prog=prog,
        description="Bridge one vLLM engine's KV-cache events into the shared index in Redis.",
    )
    add_arguments(parser)
    return parser


async def _serve_http(stack: contextlib.AsyncExitStack, app: web.Application, settings: AgentSettings) -> None:
    runner = OpenAIErrorsRunner(app, access_log=None)
    await runner.setup()
    stack.push_async_callback(runner.cleanup)
    address = f"{settings.metrics_host}:{settings.metrics_port}"
    with listening("the agent's /health and /metrics", address, "--metrics-port"):
        await web.TCPSite(runner, settings.metrics_host, settings.metrics_port).start()


async def run_agent(settings: AgentSettings) -> int:
    """Start everything, run the agent until SIGTERM/SIGINT (or it stops itself), close all."""
    stop = asyncio.Event()
    async with contextlib.AsyncExitStack() as stack:
        stack.enter_context(on_signals(stop.set))
        # An agent reads back what it wrote (its buckets' op ids, its record): from the masters
        # always; replica reads are for routers.
        client = dataclasses.replace(settings.redis, read_from_replicas=False).client()
        stack.push_async_callback(client.aclose)
        context = zmq.asyncio.Context()
        stack.callback(context.destroy, linger=0)
        subscriber = context.socket(zmq.SUB)
        stack.callback(subscriber.close, linger=0)
        if not settings.polled and settings.events is not None:
            subscribe(
                subscriber, settings.events, settings.topic, settings.max_message_bytes
            )  # first: nothing published from now on is lost
        session = await stack.enter_async_context(aiohttp.ClientSession())
        counters = AgentCounters()
        registry, latency = new_registry()
        index = RedisIndex(client, KeySchema(settings.redis.prefix))
        stack.push_async_callback(index.scripts.aclose)  # its pipelined connection, after the last write
        agent = Agent(
            settings,
            index,
            EngineClient(session, settings.engine_url, settings.dp_rank),
            subscriber,
            _replay_client(context, settings),
            counters,
            latency,
            stop,
        )
        registry.register(AgentCollector(counters, lambda: agent.pipeline.translate_counters, agent.gauges))
        if settings.metrics_port:
            await _serve_http(stack, create_app(agent, registry), settings)
        _log_start(settings)
        return await agent.run()


def _replay_client(context: zmq.asyncio.Context, settings: AgentSettings) -> ReplayClient | None:
    if settings.replay is None:
        return None
    return ReplayClient(
        context,
        settings.replay,
        settings.replay_timeout_s,
        settings.replay_deadline_s,
        settings.max_message_bytes,
        settings.max_queued_bytes,
    )


def _log_start(settings: AgentSettings) -> None:
    fields = {
        "engine": settings.engine_root,
        "worker_id": settings.resolved_worker_id,
        "events": settings.events_source,
        "replay": settings.replay or "none",
        "redis": redact_url(settings.redis.url),
        "metrics_port": settings.metrics_port or "off",
    }
    log.info("agent started", extra={"fields": fields})


def run_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Settings from ``args`` (a mistake: one line, exit 2), logging, then the agent."""
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        print(f"{parser.prog}: error: {naming_the_variable(str(exc), args, os.environ)}", file=sys.stderr)
        return EXIT_BAD_SETTINGS
    configure_logging(settings.log)
    return run_service(parser.prog, lambda: run_agent(settings))


def main(argv: Sequence[str] | None = None, prog: str = "kvroute agent") -> int:
    parser = build_parser(prog)
    return run_from_args(parser.parse_args(argv), parser)
