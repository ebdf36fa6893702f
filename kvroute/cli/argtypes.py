"""Argument types shared by the subcommands: a bad value is argparse's usual error (exit status 2)."""

from __future__ import annotations

import argparse
import json


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text}")
    return value


def positive_ints(text: str) -> list[int]:
    """A comma-separated list of positive integers, e.g. '8,64,128'."""
    values = [positive_int(v.strip()) for v in text.split(",") if v.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def token_ids(text: str) -> list[int]:
    """Token ids as '1,2,3' or a JSON list '[1, 2, 3]'."""
    raw = text.strip()
    try:
        values = json.loads(raw) if raw.startswith("[") else [int(v) for v in raw.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"token ids must be integers like 1,2,3: {exc}") from None
    if not isinstance(values, list) or not all(isinstance(v, int) and 0 <= v <= 0xFFFFFFFF for v in values):
        raise argparse.ArgumentTypeError("token ids must be integers in 0..4294967295")
    return values


class DefaultsShown(argparse.HelpFormatter):
    """Help that states each option's default where it has one worth saying (argparse's
    ArgumentDefaultsHelpFormatter also says "default: None" for every option without one)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_text = action.help or ""
        if "%(default)" in help_text or "default" in help_text or not action.option_strings:
            return action.help
        if action.default in (None, False, argparse.SUPPRESS) or action.required:
            return action.help
        return f"{help_text} (default: %(default)s)" if help_text else "default: %(default)s"
