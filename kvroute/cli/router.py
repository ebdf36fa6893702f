"""``kvroute router``: a router replica (the same as ``python -m router``)."""

from __future__ import annotations

from typing import Any

from router.main import run_from_args
from router.settings import add_arguments


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "router",
        help="run a KV-cache-aware router replica",
        description="An OpenAI-compatible router that sends each request to the worker with the longest cached prefix.",
    )
    add_arguments(parser)
    parser.set_defaults(handler=lambda args: run_from_args(args, parser))
