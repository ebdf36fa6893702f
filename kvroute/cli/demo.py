"""``kvroute demo``: the whole stack on this machine, kv routing against round robin."""

from __future__ import annotations

import argparse
from typing import Any

from kvindex.settings import add_redis_security_arguments, export_redis_security_arguments
from kvroute.cli.argtypes import positive_int


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "demo",
        help="run the whole stack here and compare kv routing with round robin",
        description="Start Redis (unless --redis-url), 4 simulated engines with agents and 2 router replicas, "
        "drive multi-turn chats through them with the kv policy and with round_robin, print a table and a chart.",
    )
    parser.add_argument("--redis-url", help="use this Redis instead of starting a private one")
    add_redis_security_arguments(parser)
    parser.add_argument("--engines", type=positive_int, default=4, help="simulated engines (default 4)")
    parser.add_argument("--conversations", type=positive_int, default=24, help="concurrent conversations (default 24)")
    parser.add_argument("--turns", type=positive_int, default=6, help="turns per conversation (default 6)")
    parser.add_argument("--chart", default="kvroute-demo.png", help="where to write the PNG chart")
    parser.add_argument("--json", help="also write the table as JSON here")
    parser.add_argument(
        "--keep",
        action="store_true",
        help="afterwards keep the stack running with kv routers and live traffic, and print their dashboard "
        "URLs, until Ctrl-C",
    )
    parser.set_defaults(handler=_run, prog=parser.prog)


def _run(args: argparse.Namespace) -> int:
    from kvroute.demo import run_from_args  # matplotlib and the stack: only when the demo runs

    export_redis_security_arguments(args)  # the processes it starts read them from the environment
    return run_from_args(args)
