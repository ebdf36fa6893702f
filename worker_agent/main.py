"""``kvroute agent`` / ``python -m worker_agent``: wires settings, clients and the agent together."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

import aiohttp
import uvloop
import zmq.asyncio
from aiohttp import web

from kvindex.keys import KeySchema
from kvindex.redis_index import RedisIndex
from kvindex.settings import redact_url
from worker_agent.agent import Agent
from worker_agent.engine import EngineClient
from worker_agent.http import create_app
from worker_agent.metrics import AgentCollector, AgentCounters, new_registry
from worker_agent.pipeline import EventPipeline
from worker_agent.settings import AgentSettings, add_arguments, settings_from_args

log = logging.getLogger("worker_agent")


def build_parser(prog: str = "kvroute agent") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Bridge one vLLM engine's KV-cache events into the shared index in Redis.",
    )
    add_arguments(parser)
    return parser


async def run_agent(settings: AgentSettings) -> int:
    counters = AgentCounters()
    registry, latency = new_registry()
    client = settings.redis.client()
    index = RedisIndex(client, KeySchema(settings.redis.prefix))
    context = zmq.asyncio.Context()
    async with aiohttp.ClientSession() as session:
        agent = Agent(
            settings,
            index,
            EngineClient(session, settings.engine_url, settings.dp_rank),
            context,
            lambda writer, translator, replay: EventPipeline(
                writer, translator, replay, settings.topic, counters, latency
            ),
            counters,
        )
        registry.register(AgentCollector(counters, lambda: agent.pipeline.translator.counters, agent.gauges))
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, agent.stop)
        runner = web.AppRunner(create_app(agent, registry), access_log=None)
        await runner.setup()
        if settings.metrics_port:
            await web.TCPSite(runner, settings.metrics_host, settings.metrics_port).start()
        log.info(
            "agent for %s (worker %s): events %s, replay %s, redis %s, metrics port %s",
            settings.engine_root, settings.resolved_worker_id, settings.events, settings.replay or "none",
            redact_url(settings.redis.url), settings.metrics_port or "off",
        )  # fmt: skip
        try:
            return await agent.run()
        finally:
            await runner.cleanup()
            await client.aclose()
            context.destroy(linger=0)


def run_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))  # exits 2 with the message
    log_format = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=args.log_level, format=log_format, stream=sys.stderr)
    return uvloop.run(run_agent(settings))


def main(argv: Sequence[str] | None = None, prog: str = "kvroute agent") -> int:
    parser = build_parser(prog)
    return run_from_args(parser.parse_args(argv), parser)
