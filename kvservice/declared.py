"""Settings declared once (issue 56, item 3).

Each field of a command's frozen settings dataclass that a user can set carries one
:class:`Declared` in its metadata: its flag, its ``KVROUTE_*`` variable, how text becomes its
value, and its help. From those fields :func:`add_declared` makes argparse's flags,
:func:`read_declared` builds the dataclass (a flag, else its variable when set and not empty, else
the field's default) and :func:`settings_table` writes the docs' settings table. A field whose
value is itself a settings dataclass (the Redis connection, the scoring weights) is marked
:func:`nested` and declares its own fields.

A malformed value is a ValueError naming where it came from: the flag, or the variable when the
user set that. Flags reach argparse as text (switches as True/False, lists as lists): every value
is parsed here, by the same function whichever way it came.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Collection, Iterator, Mapping
from enum import Enum, StrEnum
from typing import Any, TypeVar

from kvservice.options import parse_as, parse_switch

SETTING = "kvroute.declared"
DEFAULT_PREFIX = "KVROUTE_"  # a settings class's VARIABLE_PREFIX (a ClassVar) replaces it for its fields
NESTED = "kvroute.nested"
T = TypeVar("T")
E = TypeVar("E", bound=StrEnum)
Parse = Callable[[str, str], Any]  # (where the text came from: a flag or a variable, the text) -> value


class Kind(StrEnum):
    VALUE = "value"  # --flag TEXT
    SWITCH = "switch"  # --flag: on (the variable: 1/true/yes/on or 0/false/no/off)
    TOGGLE = "toggle"  # --flag / --no-flag
    LIST = "list"  # --flag TEXT, repeatable; the variable: comma-separated; both together


def text(_where: str, value: str) -> str:
    return value


def of_type(kind: Callable[[str], T]) -> Parse:
    """Text as ``kind`` (int, float): a ValueError naming where it came from otherwise."""
    return lambda where, value: parse_as(kind, where, value)


def one_of(kind: type[E]) -> Parse:
    """One of an enum's values (any case), else a ValueError naming the values."""

    def parse(where: str, value: str) -> E:
        try:
            return kind(value.strip().lower())
        except ValueError:
            raise ValueError(f"{where} must be one of {', '.join(m.value for m in kind)}, got {value!r}") from None

    return parse


@dataclasses.dataclass(frozen=True)
class Declared:
    """How a user sets one field."""

    flag: str
    help: str
    parse: Parse = text
    kind: Kind = Kind.VALUE
    variable: str = ""  # empty: the class's VARIABLE_PREFIX (KVROUTE_) and the flag's name, upper case
    metavar: str | None = None
    choices: tuple[str, ...] = ()  # shown by --help and the docs; ``parse`` checks them
    shown_default: str | None = None  # the default as a user reads it, where the value's own text is not
    group: str = ""  # the --help section
    to_field: Callable[[Any], Any] | None = None  # the parsed value in the field's unit or type
    aliases: tuple[str, ...] = ()  # older flags that set it too
    many: bool = False  # a list whose flag takes several values at once (--flag A B), as vLLM's

    @property
    def env(self) -> str:
        return self.variable or DEFAULT_PREFIX + self.dest.upper()

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")


def setting(
    default: Any = dataclasses.MISSING,
    *,
    default_factory: Any = dataclasses.MISSING,
    repr: bool = True,
    **declared: Any,
) -> Any:
    """A dataclass field that a user sets with the flag and variable ``declared`` describes."""
    return dataclasses.field(
        default=default, default_factory=default_factory, repr=repr, metadata={SETTING: Declared(**declared)}
    )


def nested(factory: type) -> Any:
    """A field holding another settings dataclass, whose own fields are declared."""
    return dataclasses.field(default_factory=factory, metadata={NESTED: factory})


def declared_fields(cls: type) -> Iterator[tuple[dataclasses.Field[Any], Declared]]:
    """Every declared field of ``cls`` and of its nested settings, in declaration order."""
    for f in dataclasses.fields(cls):
        if NESTED in f.metadata:
            yield from declared_fields(f.metadata[NESTED])
        elif SETTING in f.metadata:
            yield f, _declared(cls, f)


def variables_of(cls: type) -> dict[str, str]:
    """Each flag of ``cls``' declared fields (its aliases too) -> its variable."""
    return {flag: d.env for _, d in declared_fields(cls) for flag in (d.flag, *d.aliases)}


def _declared(cls: type, f: dataclasses.Field[Any]) -> Declared:
    """The field's declaration, its variable named by the class's prefix where it names none."""
    declared: Declared = f.metadata[SETTING]
    if declared.variable:
        return declared
    prefix = getattr(cls, "VARIABLE_PREFIX", DEFAULT_PREFIX)
    return dataclasses.replace(declared, variable=prefix + declared.dest.upper())


def add_declared(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    sections: Mapping[str, str] | None = None,
    only: Collection[str] | None = None,
) -> None:
    """The flags of ``cls``'s declared fields (``only`` these flags, when given); a field's
    ``group`` is a --help section, described by ``sections`` when it names one."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f, declared in declared_fields(cls):
        if only is not None and declared.flag not in only:
            continue
        target: Any = parser
        if declared.group and isinstance(parser, argparse.ArgumentParser):
            if declared.group not in groups:
                groups[declared.group] = parser.add_argument_group(declared.group, (sections or {}).get(declared.group))
            target = groups[declared.group]
        _add_flag(target, declared, f"{declared.help} (env {declared.env}; default {shown_default(f, declared)})")


def _add_flag(target: Any, declared: Declared, help_text: str) -> None:
    help_text = help_text.replace("%", "%%")  # argparse formats help with %
    if declared.kind is Kind.SWITCH:
        target.add_argument(declared.flag, *declared.aliases, action="store_true", default=None, help=help_text)
    elif declared.kind is Kind.TOGGLE:
        target.add_argument(declared.flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
    else:
        target.add_argument(
            declared.flag,
            *declared.aliases,
            dest=declared.dest,
            action=("extend" if declared.many else "append") if declared.kind is Kind.LIST else "store",
            nargs="+" if declared.many else None,
            default=None,
            # the choices are shown, and checked by ``parse`` (which may take any case)
            metavar=declared.metavar or ("{" + ",".join(declared.choices) + "}" if declared.choices else None),
            help=help_text,
        )


_ABSENT = object()


def read_declared(cls: type[T], args: argparse.Namespace, env: Mapping[str, str], **given: Any) -> T:
    """``cls`` from the flags in ``args``, else the variables in ``env``, else the defaults;
    ``given`` (values the caller derived) wins. A required field that none sets is a ValueError
    naming its flag and variable."""
    values: dict[str, Any] = {}
    missing: list[tuple[str, Declared]] = []
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if NESTED in f.metadata:
            values[f.name] = read_declared(f.metadata[NESTED], args, env)
        elif SETTING in f.metadata:
            declared = _declared(cls, f)
            value = _value(declared, args, env)
            if value is not _ABSENT:
                values[f.name] = value
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                missing.append((f.name, declared))
    values.update(given)
    if unset := [d for name, d in missing if name not in given]:
        named = ", ".join(f"{d.flag} (or {d.env})" for d in unset)
        raise ValueError(f"missing required setting(s): {named}")
    return cls(**values)


def _value(declared: Declared, args: argparse.Namespace, env: Mapping[str, str]) -> Any:
    flag = getattr(args, declared.dest, None)
    variable = env.get(declared.env, "").strip()
    if declared.kind is Kind.LIST:
        items = [declared.parse(declared.flag, item) for item in flag or ()]
        items += [declared.parse(declared.env, item.strip()) for item in variable.split(",") if item.strip()]
        if not items:
            return _ABSENT
        value: Any = tuple(items)
    elif flag is not None:
        value = flag if declared.kind in (Kind.SWITCH, Kind.TOGGLE) else declared.parse(declared.flag, flag)
    elif variable:
        switch = declared.kind in (Kind.SWITCH, Kind.TOGGLE)
        value = parse_switch(declared.env, variable) if switch else declared.parse(declared.env, variable)
    else:
        return _ABSENT
    return declared.to_field(value) if declared.to_field else value


def shown_default(f: dataclasses.Field[Any], declared: Declared) -> str:
    """The default as a user reads it: ``shown_default``, else the value written out."""
    if declared.shown_default is not None:
        return declared.shown_default
    if f.default is not dataclasses.MISSING:
        return show(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return show(f.default_factory())
    return "required"


def show(value: Any) -> str:
    if value is None or (isinstance(value, tuple | frozenset | dict) and not value):
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, Enum):
        return str(value.value)
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, Mapping):
        return ",".join(f"{k}={show(v)}" for k, v in value.items())
    if isinstance(value, tuple | frozenset):
        return ",".join(show(v) for v in value)
    return str(value) if value != "" else '""'


def settings_table(*classes: type) -> str:
    """The settings of ``classes`` as the docs' markdown table: one row per flag."""
    rows = ["| flag | variable | default | meaning |", "|---|---|---|---|"]
    for cls in classes:
        for f, declared in declared_fields(cls):
            rows.append(
                f"| {_flag_cell(declared)} | `{declared.env}` | {_cell(shown_default(f, declared))} | "
                f"{_cell(declared.help)} |"
            )
    return "\n".join(rows) + "\n"


def _flag_cell(declared: Declared) -> str:
    name = f"--[no-]{declared.flag[2:]}" if declared.kind is Kind.TOGGLE else declared.flag
    value = "|".join(declared.choices) if declared.choices else declared.metavar
    flags = [f"`{name} {value}`" if value else f"`{name}`", *(f"`{alias}`" for alias in declared.aliases)]
    return _cell(", ".join(flags))


_PIPE = "\\|"  # a | inside a markdown table's cell


def _cell(value: str) -> str:
    return value.replace("|", _PIPE)
