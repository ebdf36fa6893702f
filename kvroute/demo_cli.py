"""``kvroute demo``: the whole stack on this machine, kv routing against round robin."""

from __future__ import annotations

from typing import Any


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "demo",
        help="run the whole stack here and compare kv routing with round robin",
        description="Start Redis (unless --redis-url), 4 simulated engines with agents and 2 router replicas, "
        "drive multi-turn chats through them with the kv policy and with round_robin, print a table and a chart.",
    )
    parser.add_argument("--redis-url", help="use this Redis instead of starting a private one")
    parser.add_argument("--engines", type=int, default=4, help="simulated engines (default 4)")
    parser.add_argument("--conversations", type=int, default=24, help="concurrent conversations (default 24)")
    parser.add_argument("--turns", type=int, default=6, help="turns per conversation (default 6)")
    parser.add_argument("--chart", default="kvroute-demo.png", help="where to write the PNG chart")
    parser.add_argument("--json", help="also write the table as JSON here")

    def run(args: Any) -> int:
        if args.engines < 1 or args.conversations < 1 or args.turns < 1:
            parser.error("--engines, --conversations and --turns must be at least 1")
        from kvroute.demo import run_from_args

        return run_from_args(args)

    parser.set_defaults(handler=run)
