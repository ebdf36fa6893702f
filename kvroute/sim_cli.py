"""``kvroute sim-engine``: a simulated vLLM engine (HTTP API, KV events, timing model)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from typing import Any

import uvloop

from sim_engine.server import running_engine
from sim_engine.settings import SimEngineSettings, add_arguments, settings_from_args

log = logging.getLogger("sim_engine")


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "sim-engine",
        help="run a simulated vLLM engine",
        description="A simulated vLLM engine: OpenAI API, prefix caching with vLLM's semantics, KV events.",
    )
    add_arguments(parser)
    parser.set_defaults(handler=lambda args: _run(args, parser))


async def _serve(settings: SimEngineSettings) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with running_engine(settings) as running:
        log.info("simulated engine %s on %s: events %s, replay %s, %d blocks of %d tokens",
                 settings.model, running.url, running.events_endpoint, running.replay_endpoint,
                 settings.num_blocks, settings.block_size)  # fmt: skip
        await stop.wait()


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvloop.run(_serve(settings))
    return 0
