"""``kvroute router`` / ``python -m router``: wires settings, clients and the app together."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import aiohttp
import uvloop
from aiohttp import web

from kvindex.keys import KeySchema
from kvindex.redis_index import RedisIndex
from kvindex.settings import redact_url
from router.shared_load import SharedLoad
from router.app import RouterState, create_app
from router.decide import Decider
from router.fleet import Fleet
from router.load import ReplicaLoad
from router.metrics import new_metrics
from router.prompts import Tokenization
from router.settings import RouterSettings, add_arguments, settings_from_args

log = logging.getLogger("router")


@dataclass
class RunningRouter:
    url: str
    state: RouterState


@asynccontextmanager
async def running_router(settings: RouterSettings) -> AsyncIterator[RunningRouter]:
    """Run a router replica in this event loop until the block exits (tests, the demo)."""
    client = settings.redis.client(command_timeouts=False)
    schema = KeySchema(settings.redis.prefix)
    index = RedisIndex(client, schema)
    fleet = Fleet(index, settings.workers_refresh_s)
    try:
        await fleet.refresh()
    except Exception as exc:
        log.warning("could not list workers at start (%s); retrying in the background", exc)
    fleet.start()
    shared = SharedLoad(client, schema, settings.replica_id, index.scripts)
    load = ReplicaLoad(shared, settings.lease_ttl_ms, settings.expected_ttl_ms).start(fleet.models_with_workers)
    timeout = aiohttp.ClientTimeout(total=None, connect=settings.connect_timeout_s, sock_read=settings.read_timeout_s)
    session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0, limit_per_host=0),
                                    auto_decompress=False)  # fmt: skip
    decider = Decider(index, shared, fleet, settings.weights, settings.policy, settings.redis_timeout_s,
                      settings.expected_ttl_ms, load.unsent)  # fmt: skip
    state = RouterState(settings, index, fleet, decider, load, Tokenization(settings.tokenizer_dirs, session), session,
                        new_metrics())  # fmt: skip
    runner = web.AppRunner(create_app(state), access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield RunningRouter(f"http://{settings.host}:{port}", state)
    finally:
        await runner.cleanup()
        await load.stop(fleet.models_with_workers())
        await fleet.stop()
        await session.close()
        await client.aclose()


async def serve(settings: RouterSettings) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with running_router(settings) as router:
        log.info("router %s on %s (policy %s, redis %s)", settings.replica_id, router.url, settings.policy.value,
                 redact_url(settings.redis.url))  # fmt: skip
        await stop.wait()


def build_parser(prog: str = "kvroute router") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="A KV-cache-aware OpenAI-compatible router.")
    add_arguments(parser)
    return parser


def run_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    uvloop.run(serve(settings))
    return 0


def main(argv: Sequence[str] | None = None, prog: str = "kvroute router") -> int:
    parser = build_parser(prog)
    return run_from_args(parser.parse_args(argv), parser)
