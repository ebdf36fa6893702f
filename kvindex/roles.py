"""A worker's part in a prefill/decode (P/D) disaggregated fleet, as it registers it.

* ``both``: a complete engine (the default, and every worker of an aggregated fleet). It serves
  whole requests, and either leg of a split one.
* ``prefill``: it computes prompts for other engines to decode (a split request's first leg,
  answered with one token and the ``kv_transfer_params`` that name its KV blocks). Whether it also
  serves whole requests is the router's setting (--pd-whole-on): a vLLM engine is complete.
* ``decode``: it decodes from KV computed elsewhere (a split request's second leg). Such an engine
  is complete too (vLLM's disaggregated engines run with ``kv_role`` ``kv_both``), so it also
  serves whole requests that are cheaper unsplit (short, or mostly cached where they land).

Pure: no I/O.
"""

from __future__ import annotations

BOTH = "both"
PREFILL = "prefill"
DECODE = "decode"
ROLES = (BOTH, PREFILL, DECODE)

# vLLM's --kv-transfer-config kv_role -> ours. NIXL and P2P fleets run every engine as kv_both
# and leave the split to the proxy: such an engine's role comes from the agent's --role.
KV_ROLES = {"kv_producer": PREFILL, "kv_consumer": DECODE, "kv_both": BOTH}


def role_of_kv_role(kv_role: str) -> str:
    """Our role for vLLM's ``kv_role``; ValueError naming the known ones for another."""
    try:
        return KV_ROLES[kv_role]
    except KeyError:
        raise ValueError(f"kv_role must be one of {', '.join(KV_ROLES)}, got {kv_role!r}") from None


def serves_whole(role: str) -> bool:
    """Whether a worker of ``role`` takes unsplit requests where prefill workers are kept to
    prefill legs (the router's --pd-whole-on decode)."""
    return role != PREFILL


def serves_prefill_leg(role: str) -> bool:
    return role != DECODE


def serves_decode_leg(role: str) -> bool:
    return role != PREFILL
