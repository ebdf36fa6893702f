"""``kvroute agent``: the worker agent (the same as ``python -m worker_agent``)."""

from __future__ import annotations

from typing import Any

from worker_agent.main import run_from_args
from worker_agent.settings import add_arguments


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "agent",
        help="bridge one engine's KV-cache events (vLLM, SGLang or TensorRT-LLM) into the index",
        description="Bridge one vLLM engine's KV-cache events into the shared index in Redis.",
    )
    add_arguments(parser)
    parser.set_defaults(handler=lambda args: run_from_args(args, parser))
