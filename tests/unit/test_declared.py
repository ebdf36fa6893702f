"""kvservice.declared: a setting from its flag, else its variable, else its default; its parse
and its errors; the docs' table made from the same declarations."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from enum import StrEnum

import pytest

from kvservice.declared import Kind, add_declared, nested, of_type, one_of, read_declared, setting, settings_table


class Colour(StrEnum):
    RED = "red"
    BLUE = "blue"


@dataclass(frozen=True)
class Inner:
    depth: int = setting(3, flag="--depth", parse=of_type(int), help="how deep")


@dataclass(frozen=True)
class Example:
    name: str = setting(flag="--name", help="required")
    port: int = setting(8080, flag="--port", parse=of_type(int), help="a port")
    colour: Colour = setting(Colour.RED, flag="--colour", parse=one_of(Colour), choices=tuple(Colour), help="c")
    timeout_s: float = setting(
        0.05, flag="--timeout-ms", parse=of_type(float), to_field=lambda ms: ms / 1000, shown_default="50", help="t"
    )
    verbose: bool = setting(False, flag="--verbose", kind=Kind.SWITCH, help="v")
    headers: bool | None = setting(None, flag="--headers", kind=Kind.TOGGLE, help="h")
    hosts: tuple[str, ...] = setting((), flag="--host", variable="KVROUTE_HOSTS", kind=Kind.LIST, help="a|b")
    inner: Inner = nested(Inner)
    fixed: int = 7  # no flag: not a user's setting


def _read(argv: list[str], env: dict[str, str] | None = None) -> Example:
    parser = argparse.ArgumentParser()
    add_declared(parser, Example)
    return read_declared(Example, parser.parse_args(argv), env or {})


def test_the_flag_wins_then_the_variable_then_the_default():
    assert _read(["--name", "a"]).port == 8080
    assert _read(["--name", "a"], {"KVROUTE_PORT": "9000"}).port == 9000
    assert _read(["--name", "a", "--port", "9001"], {"KVROUTE_PORT": "9000"}).port == 9001
    assert _read(["--name", "a"], {"KVROUTE_PORT": "  "}).port == 8080  # set but empty: unset
    assert _read([], {"KVROUTE_NAME": "from-env"}).name == "from-env"


def test_nested_settings_and_units():
    read = _read(["--name", "a", "--timeout-ms", "250"], {"KVROUTE_DEPTH": "9"})
    assert read.timeout_s == 0.25 and read.inner == Inner(9) and read.fixed == 7


def test_switches_toggles_and_lists():
    assert _read(["--name", "a"]).verbose is False
    assert _read(["--name", "a", "--verbose"]).verbose is True
    assert _read(["--name", "a"], {"KVROUTE_VERBOSE": "yes"}).verbose is True
    assert _read(["--name", "a"], {"KVROUTE_HEADERS": "0"}).headers is False
    assert _read(["--name", "a", "--no-headers"], {"KVROUTE_HEADERS": "1"}).headers is False
    listed = _read(["--name", "a", "--host", "x", "--host", "y"], {"KVROUTE_HOSTS": "z, w,"})
    assert listed.hosts == ("x", "y", "z", "w")  # a list's variable adds to its flags


def test_errors_name_where_the_value_came_from():
    with pytest.raises(ValueError, match=r"^--port must be an integer, got 'x'$"):
        _read(["--name", "a", "--port", "x"])
    with pytest.raises(ValueError, match=r"^KVROUTE_PORT must be an integer, got 'x'$"):
        _read(["--name", "a"], {"KVROUTE_PORT": "x"})
    with pytest.raises(ValueError, match=r"^KVROUTE_COLOUR must be one of red, blue, got 'green'$"):
        _read(["--name", "a"], {"KVROUTE_COLOUR": "green"})
    with pytest.raises(ValueError, match=r"^KVROUTE_VERBOSE must be 1 or 0"):
        _read(["--name", "a"], {"KVROUTE_VERBOSE": "maybe"})
    with pytest.raises(ValueError, match=r"^missing required setting\(s\): --name \(or KVROUTE_NAME\)$"):
        _read([])


def test_choices_take_any_case():
    assert _read(["--name", "a", "--colour", "BLUE"]).colour is Colour.BLUE


def test_the_table_has_a_row_per_flag_with_its_variable_and_default():
    rows = settings_table(Example).splitlines()
    assert rows[0] == "| flag | variable | default | meaning |"
    assert "| `--name` | `KVROUTE_NAME` | required | required |" in rows
    assert "| `--colour red\\|blue` | `KVROUTE_COLOUR` | red | c |" in rows
    assert "| `--timeout-ms` | `KVROUTE_TIMEOUT_MS` | 50 | t |" in rows
    assert "| `--[no-]headers` | `KVROUTE_HEADERS` | none | h |" in rows
    assert "| `--host` | `KVROUTE_HOSTS` | none | a\\|b |" in rows
    assert "| `--depth` | `KVROUTE_DEPTH` | 3 | how deep |" in rows
    assert len(rows) == 2 + 8  # the header, its rule, eight flags (not the undeclared field)
