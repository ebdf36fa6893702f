"""The ``kvroute`` command: one entry point, one module per subcommand.

Each module adds its subcommand's parser and hands the parsed arguments to the package that does
the work (``router``, ``worker_agent``, ``sim_engine``, :mod:`kvroute.bench`, :mod:`kvroute.demo`).
A :class:`~kvservice.lifecycle.StartupError` raised by a handler (a bad setting, a Redis that
cannot be used) is printed as one line, ``PROG: error: MESSAGE``, with exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvroute import __version__
from kvroute.cli import agent, bench, demo, epp, index, redis_users, router, settings, sim
from kvservice.lifecycle import EXIT_BAD_SETTINGS, EXIT_INTERRUPTED, StartupError
from kvservice.options import Parser


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="kvroute", description="KV-cache-aware routing for LLM inference fleets, with a shared index in Redis."
    )
    parser.add_argument("--version", action="version", version=f"kvroute {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in (demo, index, agent, sim, router, epp, bench, redis_users, settings):
        module.add_parser(commands)
    for command in commands.choices.values():  # the innermost parser given, for its own errors
        _own_parser_below(command)
    return parser


def _own_parser_below(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(command_parser=parser)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _own_parser_below(sub)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # told by the subcommand's parser: its name, its --help
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return int(args.handler(args) or 0)
    except StartupError as exc:
        print(f"{getattr(args, 'prog', parser.prog)}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_SETTINGS
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
