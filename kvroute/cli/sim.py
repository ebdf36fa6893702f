"""``kvroute sim-engine``: a simulated vLLM engine (the same as ``python -m sim_engine``)."""

from __future__ import annotations

from typing import Any

from sim_engine.main import DESCRIPTION, run_from_args
from sim_engine.settings import add_arguments


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "sim-engine",
        help="run a simulated engine (vLLM's API and KV events; SGLang's or TensorRT-LLM's with --engine-kind)",
        description=DESCRIPTION,
    )
    add_arguments(parser)
    parser.set_defaults(handler=lambda args: run_from_args(args, parser))
