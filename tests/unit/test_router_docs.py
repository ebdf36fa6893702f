"""docs/router.md's settings table names every flag of ``kvroute router`` (a flag added without
its row is a setting operators cannot find), and every flag it names exists (a row left behind by
a rename points at nothing). ``--[no-]X`` stands for ``--X`` and ``--no-X``."""

from __future__ import annotations

import re

from router.main import build_parser
from tests.support import ROOT


def _table() -> str:
    text = (ROOT / "docs" / "router.md").read_text()
    return text[text.index("## Settings") : text.index("## Endpoints")]


def _flags() -> set[str]:
    return {o for a in build_parser()._actions for o in a.option_strings if o.startswith("--") and o != "--help"}


def _named(table: str) -> set[str]:
    """The flags in the first column of the table's rows (what each row is about)."""
    named: set[str] = set()
    firsts = [line.split(" | ")[0] for line in table.splitlines() if line.startswith("| `--")]
    for flag in re.findall(r"`(--[a-z\[\]-]+)", "\n".join(firsts)):
        if flag.startswith("--[no-]"):
            named |= {"--" + flag[len("--[no-]") :], "--no-" + flag[len("--[no-]") :]}
        else:
            named.add(flag)
    return named


def test_every_router_flag_has_a_row_and_every_row_a_flag():
    flags, named = _flags(), _named(_table())
    assert not flags - named, f"flags without a row in docs/router.md's settings table: {sorted(flags - named)}"
    assert not named - flags, f"rows naming no flag of kvroute router: {sorted(named - flags)}"
