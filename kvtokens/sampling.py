"""The sampling fields of an OpenAI completions or chat request, checked as vLLM checks them
(its ``SamplingParams`` and request models), so that a router or an engine answers 400 naming the
field instead of passing ``"temperature": "hot"`` or ``"n": 0`` on. Pure: no I/O.

Numbers must be JSON numbers (a boolean or a numeric string is refused: OpenAI's API refuses them);
a field that is absent or null is the engine's default. Fields not listed here are the engine's
to judge.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class SamplingError(ValueError):
    """A field out of its range or of the wrong type; ``param`` names it (OpenAI's ``param``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Bound:
    """A number field's rule: its kind, its bounds (inclusive unless ``open_low``), its words."""

    integer: bool
    low: float | None = None
    high: float | None = None
    open_low: bool = False
    rule: str = ""


# vLLM's rules (SamplingParams._verify_args; the OpenAI protocol's request fields).
NUMBERS: dict[str, Bound] = {
    "n": Bound(True, 1, rule="an integer of at least 1"),
    "best_of": Bound(True, 1, rule="an integer of at least 1"),
    "max_tokens": Bound(True, 1, rule="an integer of at least 1"),
    "max_completion_tokens": Bound(True, 1, rule="an integer of at least 1"),
    "min_tokens": Bound(True, 0, rule="an integer of at least 0"),
    "temperature": Bound(False, 0, rule="a number of at least 0"),
    "top_p": Bound(False, 0, 1, open_low=True, rule="a number above 0 and at most 1"),
    "top_k": Bound(True, -1, rule="an integer: -1 or 0 (every token), or at least 1"),
    "min_p": Bound(False, 0, 1, rule="a number from 0 to 1"),
    "presence_penalty": Bound(False, -2, 2, rule="a number from -2 to 2"),
    "frequency_penalty": Bound(False, -2, 2, rule="a number from -2 to 2"),
    "repetition_penalty": Bound(False, 0, open_low=True, rule="a number above 0"),
    "seed": Bound(True, rule="an integer"),
}
SAMPLING_FIELDS = (*NUMBERS, "stop")


def check_sampling(body: Mapping[str, Any]) -> None:
    """Raises :class:`SamplingError` for the first field of ``body`` out of its rule."""
    for name, bound in NUMBERS.items():
        value = body.get(name)
        if value is not None and not _fits(value, bound):
            raise SamplingError(f"'{name}' must be {bound.rule}, got {_shown(value)}", name)
    stop = body.get("stop")
    if stop is not None and not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        raise SamplingError(f"'stop' must be a string or an array of strings, got {_shown(stop)}", "stop")


def _fits(value: object, bound: Bound) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    if isinstance(value, float) and not (math.isfinite(value) and (not bound.integer or value.is_integer())):
        return False  # 2.0 is 2, as vLLM's request models take it; NaN and infinities are nothing
    if bound.low is not None and (value <= bound.low if bound.open_low else value < bound.low):
        return False
    return bound.high is None or value <= bound.high


def _shown(value: object) -> str:
    """The value as the client sent it, cut short: an error message is one line."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_context_length(body: Mapping[str, Any], prompt_tokens: int, max_model_len: int | None) -> None:
    """vLLM's refusal, before the request reaches an engine: a prompt longer than the model's
    context, or a prompt and the reply it asks for (``max_tokens`` or ``max_completion_tokens``)
    that do not fit in it. ``max_model_len`` None: not known, nothing checked."""
    if not max_model_len:
        return
    if prompt_tokens > max_model_len:
        message = (
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
            f"{prompt_tokens} tokens. Please reduce the length of the prompt."
        )
        raise SamplingError(message, "messages" if "messages" in body else "prompt")
    for name in ("max_completion_tokens", "max_tokens"):
        asked = body.get(name)
        if isinstance(asked, int) and not isinstance(asked, bool) and prompt_tokens + asked > max_model_len:
            message = (
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{prompt_tokens + asked} tokens ({prompt_tokens} in the prompt, {asked} in the completion). "
                "Please reduce the length of the prompt or completion."
            )
            raise SamplingError(message, name)
