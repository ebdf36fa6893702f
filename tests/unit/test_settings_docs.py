"""The settings tables of docs/router.md, docs/agent.md and docs/sim-engine.md name every flag of
``kvroute router``, ``kvroute agent`` and ``kvroute sim-engine`` (a flag added without its row is a
setting operators cannot find), and every flag they name exists (a row left behind by a rename
points at nothing). ``--[no-]X`` stands for ``--X`` and ``--no-X``."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable

import pytest

from kvroute.cli.settings import DECLARED
from kvservice.declared import settings_table
from router.main import build_parser as router_parser
from sim_engine.main import build_parser as sim_parser
from tests.support import ROOT
from worker_agent.main import build_parser as agent_parser

TABLES = [
    (router_parser, "router.md", "## Settings", "## Endpoints"),
    (agent_parser, "agent.md", "## Settings", "## Engine kinds"),
    (sim_parser, "sim-engine.md", "## Flags", "## HTTP API"),
]


def _table(page: str, start: str, end: str) -> str:
    text = (ROOT / "docs" / page).read_text()
    return text[text.index(start) : text.index(end)]


def _flags(parser: Callable[[], argparse.ArgumentParser]) -> set[str]:
    return {o for a in parser()._actions for o in a.option_strings if o.startswith("--") and o != "--help"}


def _named(table: str) -> set[str]:
    """The flags in the first column of the table's rows (what each row is about)."""
    named: set[str] = set()
    firsts = [line.split(" | ")[0] for line in table.splitlines() if line.startswith("| `--")]
    for flag in re.findall(r"`(--[a-z0-9\[\]-]+)", "\n".join(firsts)):
        if flag.startswith("--[no-]"):
            named |= {"--" + flag[len("--[no-]") :], "--no-" + flag[len("--[no-]") :]}
        else:
            named.add(flag)
    return named


@pytest.mark.parametrize(("parser", "page", "start", "end"), TABLES, ids=[t[1] for t in TABLES])
def test_every_flag_has_a_row_and_every_row_a_flag(parser, page, start, end):
    flags, named = _flags(parser), _named(_table(page, start, end))
    assert not flags - named, f"flags without a row in docs/{page}'s settings table: {sorted(flags - named)}"
    assert not named - flags, f"rows in docs/{page} naming no flag: {sorted(named - flags)}"


@pytest.mark.parametrize("command", sorted(DECLARED))
def test_the_docs_table_is_the_declarations_table(command):
    """The docs' table is ``kvroute settings COMMAND``'s output: a help text, default or variable
    changed in the declarations and not in the page fails here (paste the command's output)."""
    page = {"router": "router.md", "agent": "agent.md", "sim-engine": "sim-engine.md", "epp": "kubernetes.md"}[command]
    table = settings_table(*DECLARED[command])
    assert table in (ROOT / "docs" / page).read_text(), f"docs/{page} lacks `kvroute settings {command}`'s table"
