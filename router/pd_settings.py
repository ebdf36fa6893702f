"""The prefill/decode flags (docs/router.md, "Prefill/decode fleets"): --pd-split, --pd-transfer-ms
and --pd-hop-ms, each else its KVROUTE_* variable, else the default (router.routing.pd)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from kvservice.options import flag_or_env, typed
from router.routing.pd import DEFAULT_HOP_MS, DEFAULT_TRANSFER_MS_PER_1K, PdCosts, SplitMode


def add_pd_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "prefill/decode fleets",
        "requests of a model with prefill workers (agents' --role) may be split (docs/router.md, "
        "'Prefill/decode fleets')",
    )
    group.add_argument(
        "--pd-split",
        choices=[m.value for m in SplitMode],
        help="auto: split a request when that is predicted faster (default); always: whenever a prefill and a "
        "decode worker are alive; never: whole requests only, on decode and both workers; off: roles ignored, "
        "every worker serves whole requests (env KVROUTE_PD_SPLIT)",
    )
    group.add_argument(
        "--pd-transfer-ms",
        type=float,
        help=f"KV transfer time per 1k tokens, prefill to decode engine (default {DEFAULT_TRANSFER_MS_PER_1K}: an "
        "8B model's KV at ~25 GB/s; env KVROUTE_PD_TRANSFER_MS)",
    )
    group.add_argument(
        "--pd-hop-ms",
        type=float,
        help=f"the extra round trip a split costs (default {DEFAULT_HOP_MS}; env KVROUTE_PD_HOP_MS)",
    )


def pd_costs(args: argparse.Namespace, env: Mapping[str, str]) -> PdCosts:
    given = flag_or_env(
        argparse.Namespace(
            mode=getattr(args, "pd_split", None),
            transfer_ms_per_1k=getattr(args, "pd_transfer_ms", None),
            hop_ms=getattr(args, "pd_hop_ms", None),
        ),
        env,
        [
            ("mode", "KVROUTE_PD_SPLIT", _split_mode),
            ("transfer_ms_per_1k", "KVROUTE_PD_TRANSFER_MS", typed(float)),
            ("hop_ms", "KVROUTE_PD_HOP_MS", typed(float)),
        ],
    )
    if isinstance(given.get("mode"), str):
        given["mode"] = SplitMode(given["mode"])
    return PdCosts(**given)


def _split_mode(variable: str, text: str) -> SplitMode:
    try:
        return SplitMode(text.strip().lower())
    except ValueError:
        raise ValueError(f"{variable} must be one of {', '.join(m.value for m in SplitMode)}, got {text!r}") from None
