"""The ``kvroute`` command: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvroute import __version__, agent_cli, bench_cli, demo_cli, index_cli, router_cli, sim_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvroute", description="KV-cache-aware routing for LLM inference fleets, with a shared index in Redis."
    )
    parser.add_argument("--version", action="version", version=f"kvroute {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    demo_cli.add_parser(commands)
    index_cli.add_parser(commands)
    agent_cli.add_parser(commands)
    sim_cli.add_parser(commands)
    router_cli.add_parser(commands)
    bench_cli.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
