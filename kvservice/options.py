"""The pieces of a setting's reading that every command shares: a switch's words, a typed value's
one-line error, a parser whose mistakes are one line, an error that names the variable a value came
from. The rule itself (a flag, else its ``KVROUTE_*`` variable, else its default) is
:mod:`kvservice.declared`'s.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable, Mapping
from typing import NoReturn, TypeVar

T = TypeVar("T")
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def parse_switch(variable: str, text: str) -> bool:
    """1/true/yes/on or 0/false/no/off, any case."""
    word = text.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError(f"{variable} must be 1 or 0 (true/false), got {text!r}")


def parse_as(kind: Callable[[str], T], variable: str, text: str) -> T:
    """``kind(text)`` (int, float, str...), a ValueError naming ``variable`` when it is not one."""
    try:
        return kind(text)
    except ValueError:
        what = {int: "an integer", float: "a number"}.get(kind, "valid")  # type: ignore[call-overload]
        raise ValueError(f"{variable} must be {what}, got {text!r}") from None


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose mistakes are one line: ``PROG: error: MESSAGE`` and where the
    options are listed, exit status 2 (argparse printed the whole usage first, ~30 lines for a
    router, above the line that mattered). Subcommands' parsers are of the same class."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the options)\n")


_LEADING_FLAG = re.compile(r"--([a-z0-9][a-z0-9-]*)")


def naming_the_variable(
    message: str, args: argparse.Namespace, env: Mapping[str, str], variables: Mapping[str, str] | None = None
) -> str:
    """A setting's error names its flag; when the flag was not given and its variable was (the
    value came from there), it names the variable instead: the user set that. ``variables``: each
    flag's variable (kvservice.declared.variables_of), else ``KVROUTE_`` and the flag's name."""
    flag = _LEADING_FLAG.match(message)
    if flag is None or getattr(args, flag.group(1).replace("-", "_"), None) is not None:
        return message
    variable = (variables or {}).get(flag.group(0)) or "KVROUTE_" + flag.group(1).replace("-", "_").upper()
    return variable + message[flag.end() :] if env.get(variable) else message


def fail_settings(
    parser: argparse.ArgumentParser,
    exc: ValueError,
    args: argparse.Namespace,
    variables: Mapping[str, str] | None = None,
) -> NoReturn:
    """A setting's mistake as the parser's one line (exit 2), naming the variable it came from."""
    parser.error(naming_the_variable(str(exc), args, os.environ, variables))
