"""``kvroute sim-engine`` / ``python -m sim_engine``: a simulated vLLM engine as a process."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

from kvservice.declared import variables_of
from kvservice.lifecycle import run_service, serve_until_signal
from kvservice.logs import configure_logging
from kvservice.options import Parser, fail_settings
from sim_engine.server import RunningEngine, running_engine
from sim_engine.settings import SimEngineSettings, add_arguments, settings_from_args

log = logging.getLogger("sim_engine")

DESCRIPTION = "A simulated vLLM engine: OpenAI API, prefix caching with vLLM's semantics, KV events."


def build_parser(prog: str = "kvroute sim-engine") -> argparse.ArgumentParser:
    parser = Parser(prog=prog, description=DESCRIPTION)
    add_arguments(parser)
    return parser


def _announce(settings: SimEngineSettings, running: RunningEngine) -> None:
    extras = f", a sliding window of {settings.sliding_window} beside full attention" if settings.sliding_window else ""
    connector = running.engine.connector
    if connector is not None:  # the id its prefill replies name (remote_engine_id)
        extras += f", KV transfer as engine {connector.engine_id}"
    log.info(
        "simulated engine %s on %s: events %s, replay %s, %d blocks of %d tokens%s, "
        "max-num-batched-tokens %s, max-num-seqs %d",
        settings.model,
        running.url,
        running.events_endpoint or "off",
        running.replay_endpoint or "off",
        settings.num_blocks,
        settings.block_size,
        extras,
        settings.timing.max_num_batched_tokens or "none",
        settings.timing.max_num_seqs,
    )


async def serve(settings: SimEngineSettings) -> None:
    """Serve until SIGTERM or SIGINT."""
    await serve_until_signal(running_engine(settings), lambda running: _announce(settings, running))


def run_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Validate ``args`` (a bad flag: argparse's message, exit 2), then serve until a signal."""
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        fail_settings(parser, exc, args, variables_of(SimEngineSettings))
    configure_logging(settings.log)
    return run_service(parser.prog, lambda: serve(settings))


def main(argv: Sequence[str] | None = None, prog: str = "kvroute sim-engine") -> int:
    parser = build_parser(prog)
    return run_from_args(parser.parse_args(argv), parser)
