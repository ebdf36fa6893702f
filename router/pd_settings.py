"""The prefill/decode flags (docs/router.md, "Prefill/decode fleets"): --pd-split, --pd-transfer-ms,
--pd-hop-ms, --pd-whole-on and --pd-decode-weight, each else its KVROUTE_* variable, else the default
(router.routing.pd)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from kvservice.options import choice, flag_or_env, typed
from router.routing.pd import (
    DEFAULT_DECODE_WEIGHT,
    DEFAULT_HOP_MS,
    DEFAULT_TRANSFER_MS_PER_1K,
    PdCosts,
    SplitMode,
    WholeOn,
)


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
        "decode worker are alive; never: whole requests only (on the workers --pd-whole-on names); off: roles "
        "ignored, every worker serves whole requests (env KVROUTE_PD_SPLIT)",
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
    group.add_argument(
        "--pd-whole-on",
        choices=[w.value for w in WholeOn],
        help="which workers take a request served whole: any (default): a prefill worker too, where that is "
        "cheapest (engines that are complete, as vLLM's NIXL engines, all kv_both, are); decode: decode and both "
        "workers only, for connectors whose prefill engines cannot serve alone (env KVROUTE_PD_WHOLE_ON)",
    )
    group.add_argument(
        "--pd-decode-weight",
        type=float,
        help=f"what a second of stall to the streams decoding on a worker counts against a second of the new "
        f"request's TTFT, in the split decision (default {DEFAULT_DECODE_WEIGHT}; 0: TTFT alone; 1: every "
        "user's waiting alike; env KVROUTE_PD_DECODE_WEIGHT)",
    )


def pd_costs(args: argparse.Namespace, env: Mapping[str, str]) -> PdCosts:
    given = flag_or_env(
        argparse.Namespace(
            mode=getattr(args, "pd_split", None),
            transfer_ms_per_1k=getattr(args, "pd_transfer_ms", None),
            hop_ms=getattr(args, "pd_hop_ms", None),
            whole_on=getattr(args, "pd_whole_on", None),
            decode_weight=getattr(args, "pd_decode_weight", None),
        ),
        env,
        [
            ("mode", "KVROUTE_PD_SPLIT", choice(SplitMode)),
            ("transfer_ms_per_1k", "KVROUTE_PD_TRANSFER_MS", typed(float)),
            ("hop_ms", "KVROUTE_PD_HOP_MS", typed(float)),
            ("whole_on", "KVROUTE_PD_WHOLE_ON", choice(WholeOn)),
            ("decode_weight", "KVROUTE_PD_DECODE_WEIGHT", typed(float)),
        ],
    )
    for name, kind in (("mode", SplitMode), ("whole_on", WholeOn)):
        if name in given:  # a flag's text (argparse checked it), or the variable's value
            given[name] = kind(given[name])
    return PdCosts(**given)
