"""``kvroute epp``: the router as the Gateway API Inference Extension's endpoint picker
(Envoy's ext_proc on ``--grpc-port``, beside the router's HTTP server on ``--port``)."""

from __future__ import annotations

import os
from typing import Any

from kvservice.lifecycle import StartupError


def add_parser(commands: Any) -> None:
    from router.epp.settings import add_arguments

    parser = commands.add_parser(
        "epp",
        help="run the router as a Gateway API Inference Extension endpoint picker (Envoy ext_proc)",
        description="A router replica that picks the worker for each request a gateway (Envoy) sends it over "
        "ext_proc, sharing the index and the in-flight load with every other replica (docs/kubernetes.md).",
    )
    add_arguments(parser)

    def run(args: Any) -> int:
        # gRPC's core logs to stderr on its own (a failed bind, twice over): kvroute says it once
        os.environ.setdefault("GRPC_VERBOSITY", "NONE")
        try:
            from router.epp.server import run_from_args
        except ImportError as exc:  # the epp extra is not installed
            raise StartupError(
                f"kvroute epp needs the epp extra ({exc.name} is missing): pip install 'kvroute[epp]'"
            ) from None
        return run_from_args(args, parser)

    parser.set_defaults(handler=run)
