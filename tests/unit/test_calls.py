"""Each script's declaration (kvindex.calls) against the script itself: its header's KEYS and
ARGV, and its read-only flag."""

from __future__ import annotations

import re

import pytest

from kvindex import calls as lua
from kvindex.calls import SPECS
from kvindex.keys import KeySchema
from kvindex.scripts import READ_ONLY_SCRIPTS, lua_dir

SCRIPTS = sorted(p.stem for p in lua_dir().glob("*.lua"))


def header_positions(source: str, kind: str) -> tuple[int, bool]:
    """How many fixed KEYS or ARGV positions the header names, and whether it names a tail
    (``KEYS[3..]``, ``ARGV[2..]``)."""
    header = "\n".join(line for line in source.splitlines() if line.startswith("--"))
    fixed = {int(n) for n in re.findall(rf"{kind}\[(\d+)\]", header)}
    tail = re.search(rf"{kind}\[[\d+n ]+\.\.", header) is not None
    return max(fixed, default=0), tail


def test_every_script_has_one_declaration_and_every_declaration_a_script():
    assert sorted(SPECS) == SCRIPTS


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_declaration_says_what_its_scripts_header_and_flag_say(name):
    spec = SPECS[name]
    source = (lua_dir() / f"{name}.lua").read_text()
    assert spec.read_only == source.startswith("#!lua flags=no-writes") == (name in READ_ONLY_SCRIPTS)
    for kind, names in (("KEYS", spec.keys), ("ARGV", spec.args)):
        fixed, tail = header_positions(source, kind)
        declared_fixed = sum(1 for n in names if not n.endswith("..."))
        declared_tail = bool(names) and names[-1].endswith("...")
        assert (declared_fixed, declared_tail) == (fixed, tail) or (
            declared_tail and tail and declared_fixed == fixed - 1  # 'KEYS[1..n]' declares a tail only
        ), f"{name}.lua: {kind} {names} against its header (fixed {fixed}, tail {tail})"


def test_a_call_with_the_wrong_number_of_keys_or_arguments_is_refused_before_it_is_sent():
    keys = KeySchema().for_model("m")
    assert lua.heartbeat(keys, "w", 7, 1000).args == [7, 1000]
    with pytest.raises(ValueError, match=r"heartbeat.lua takes ARGV gid, ttl_ms; 1 given"):
        lua.HEARTBEAT.call([keys.worker("w"), keys.alive, keys.alive_version], [7])
    with pytest.raises(ValueError, match=r"tally.lua takes KEYS record, meta; 3 given"):
        lua.TALLY.call(["a", "b", "c"], [1, 2, 3])
    assert len(lua.load(keys, "w", 7, 1, 0, 0.5, None).args) == 4  # the capacity is optional
    assert len(lua.load(keys, "w", 7, 1, 0, 0.5, 4096).args) == 5


def test_replies_are_parsed_by_the_declaration():
    keys = KeySchema().for_model("m")
    assert lua.heartbeat(keys, "w", 1, 1).parse(b"superseded") == "superseded"
    assert lua.swap(keys, "w", 1, 2, 3, 4).parse([b"ok", 5]) == ("ok", 5)
    assert lua.gc_finish(keys, "7").parse(1) == 1
