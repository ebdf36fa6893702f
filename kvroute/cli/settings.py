"""``kvroute settings COMMAND``: a command's settings as a markdown table (flag, variable,
default, meaning), made from the declarations its settings dataclass carries
(:mod:`kvservice.declared`); the docs' settings tables are this output."""

from __future__ import annotations

import argparse
from typing import Any

from kvservice.declared import settings_table
from router.epp.settings import EppSettings
from router.settings import RouterSettings
from sim_engine.settings import SimEngineSettings
from worker_agent.settings import AgentSettings

# The commands whose settings are declared, and their settings' dataclasses.
DECLARED: dict[str, tuple[type, ...]] = {
    "router": (RouterSettings,),
    "agent": (AgentSettings,),
    "epp": (EppSettings,),
    "sim-engine": (SimEngineSettings,),
}


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "settings",
        help="print a command's settings (flag, KVROUTE_* variable, default, meaning) as a markdown table",
        description="Every setting of a kvroute command: its flag, its KVROUTE_* variable (the flag wins), its "
        "default and what it means, as the docs' settings tables show them.",
    )
    parser.add_argument("name", choices=sorted(DECLARED), metavar="COMMAND", help=", ".join(sorted(DECLARED)))
    parser.set_defaults(handler=_print)


def _print(args: argparse.Namespace) -> int:
    print(settings_table(*DECLARED[args.name]), end="")
    return 0
