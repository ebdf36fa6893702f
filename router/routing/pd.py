"""Prefill/decode disaggregated fleets: whether to split a request, and over which two workers.

Pure functions over a decision's scores (no I/O); the two legs' forwarding is
:mod:`router.upstream.split`, the flow :mod:`router.split_flow` (docs/router.md, "Prefill/decode
fleets").

A split request is prefilled on a prefill worker, its KV handed to a decode worker by the engines'
KV connector, and decoded there. Unsplit, the worker that decodes it prefills it too, and every
sequence decoding there waits for that prefill: vLLM computes a prompt's chunk in the same step as
the running decodes, so each step that carries it takes that much longer.

* The prefill worker: the cheapest by the cost in time (:mod:`router.routing.scoring`: its cached
  prefix, the prefill queued there), among the workers that take a prefill leg.
* The decode worker: the least loaded by decode load (its running and queued sequences, or the
  requests booked there, whichever is more), the busy ones (KV cache nearly full) last; among
  equals, the one that holds more of the prompt (a connector such as NIXL loads only what the
  decode side does not hold), then at random.
* Split or not, per request, by predicted time, where a prefill stalls each sequence decoding on
  its worker by its own time, weighed by ``decode_weight`` (:data:`DEFAULT_DECODE_WEIGHT`):

      whole = TTFT there + weight x its prefill time x the sequences decoding there, on the cheapest
              worker that takes whole requests (any, or decode and both ones: :class:`WholeOn`)
      split = TTFT on the prefill worker + its stall there + the KV's transfer (the tokens the
              decode worker does not hold, at --pd-transfer-ms per 1k) + the extra hop + the
              decode worker's first step (after the prefill queued there) + the learned residual

  Split pays all that whole on its prefill worker would, and more: where prefill workers take
  whole requests, a request is split only when its prefill worker cannot take it whole. Kept off
  them, a short or mostly cached prompt is cheaper whole on a decode worker and a long uncached one
  beside busy decodes is split: llm-d's fixed threshold on the uncached tokens, moving with the
  queues and the caches.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from kvindex.roles import BOTH, PREFILL, serves_decode_leg, serves_prefill_leg, serves_whole
from kvservice.declared import of_type, one_of, setting
from router.routing.scoring import Scored, predicted_cached_tokens
from router.routing.ttft import CostModel

DEFAULT_TRANSFER_MS_PER_1K = 5.0  # 128 KiB of KV per token (8B, bf16) at ~25 GB/s (NIXL over RDMA)
DEFAULT_HOP_MS = 1.0  # the prefill's reply and the decode's request: one more round trip
# How much a second of delay to a stream already decoding counts against a second of the new
# request's TTFT. 1 would weigh every user's waiting alike (end to end); a stream mid-reply has
# tokens in hand and one longer gap in it is felt less than a later first token, so it counts half:
# a prompt is split when its prefill would stall enough decodes for long enough (docs/router.md).
DEFAULT_DECODE_WEIGHT = 0.5
PD_GROUP = "prefill/decode fleets"  # the --help section of the split settings


class SplitMode(StrEnum):
    AUTO = "auto"  # per request, by predicted time
    ALWAYS = "always"  # every request that can be split (the proxies of vLLM's examples)
    NEVER = "never"  # whole requests only (on the workers WholeOn allows)
    OFF = "off"  # roles ignored: every worker serves whole requests (an aggregated fleet)


class WholeOn(StrEnum):
    """Which workers of a fleet with prefill workers take whole (unsplit) requests."""

    ANY = "any"  # every worker, a prefill worker too where that is cheapest (complete engines)
    DECODE = "decode"  # decode and both workers only (llm-d's and Dynamo's way)


@dataclass(frozen=True)
class PdCosts:
    mode: SplitMode = setting(
        SplitMode.AUTO,
        flag="--pd-split",
        parse=one_of(SplitMode),
        choices=tuple(SplitMode),
        group=PD_GROUP,
        help="a model with prefill workers (agents' --role): auto splits a request when that is predicted faster; "
        "always whenever a prefill and a decode worker are alive; never: whole requests only (on the workers "
        "--pd-whole-on names); off: roles ignored, every worker serves whole requests",
    )
    transfer_ms_per_1k: float = setting(
        DEFAULT_TRANSFER_MS_PER_1K,
        flag="--pd-transfer-ms",
        parse=of_type(float),
        group=PD_GROUP,
        help="KV transfer time per 1k tokens, prefill to decode engine (the default: an 8B model's KV at ~25 GB/s)",
    )
    hop_ms: float = setting(
        DEFAULT_HOP_MS,
        flag="--pd-hop-ms",
        parse=of_type(float),
        group=PD_GROUP,
        help="the extra round trip a split costs",
    )
    whole_on: WholeOn = setting(
        WholeOn.ANY,
        flag="--pd-whole-on",
        parse=one_of(WholeOn),
        choices=tuple(WholeOn),
        group=PD_GROUP,
        help="which workers take a request served whole: any (a prefill worker too, where that is cheapest: "
        "complete engines such as vLLM's NIXL ones, all kv_both); decode: decode and both workers only, for "
        "connectors whose prefill engines cannot serve alone",
    )
    decode_weight: float = setting(
        DEFAULT_DECODE_WEIGHT,
        flag="--pd-decode-weight",
        parse=of_type(float),
        group=PD_GROUP,
        help="what a second of stall to the streams decoding on a worker counts against a second of the new "
        "request's TTFT, in the split decision (0: TTFT alone; 1: every user's waiting alike)",
    )

    def __post_init__(self) -> None:
        if not (self.transfer_ms_per_1k >= 0 and self.hop_ms >= 0):  # NaN too
            raise ValueError("--pd-transfer-ms and --pd-hop-ms must be >= 0")
        if not self.decode_weight >= 0:
            raise ValueError("--pd-decode-weight must be >= 0")

    def transfer_s(self, tokens: int) -> float:
        return tokens * self.transfer_ms_per_1k / 1e6

    def unsplit(self) -> PdCosts:
        """The same settings, never splitting (a degraded decision: it read no match); whole
        requests still go only where ``whole_on`` says."""
        return replace(self, mode=SplitMode.NEVER)


@dataclass(frozen=True)
class Plan:
    """Where a request goes: whole (``split`` False: ``whole``, best first) or split (``prefill``
    then ``decode``, each best first). The predicted costs are None where that way is impossible."""

    split: bool
    whole: list[Scored]
    prefill: list[Scored]
    decode: list[Scored]
    split_s: float | None = None
    whole_s: float | None = None


def plan(
    ranked: Sequence[Scored],
    roles: Mapping[str, str],
    prompt_tokens: int,
    block_size: int,
    model: CostModel,
    costs: PdCosts,
    rng: random.Random,
    baseline: Baseline | None = None,
    residual_s: float = 0.0,
) -> Plan:
    """The plan for a prompt whose decision ranked ``ranked`` (every alive worker, best first).
    ``baseline``: a baseline policy's own order of each leg's workers (the benchmarks' round-robin
    and least-loaded P/D), instead of the cost's; ``residual_s``: what decode legs took beyond
    their prediction (:class:`DecodeLegs`)."""
    if costs.mode is SplitMode.OFF:
        return Plan(False, list(ranked), [], [])
    role = {s.candidate.worker_id: roles.get(s.candidate.worker_id, BOTH) for s in ranked}
    dedicated = any(r == PREFILL for r in role.values())  # a fleet of complete engines never splits
    if not dedicated:
        whole_s = whole_cost(ranked[0], prompt_tokens, block_size, model, costs) if ranked else None
        return Plan(False, list(ranked), [], [], None, whole_s)
    whole = _whole_workers(ranked, role, prompt_tokens, block_size, model, costs)
    prefill = [s for s in ranked if serves_prefill_leg(role[s.candidate.worker_id])]
    whole_s = whole_cost(whole[0], prompt_tokens, block_size, model, costs) if whole else None
    if costs.mode is SplitMode.NEVER:
        return Plan(False, whole, [], [], None, whole_s)
    if baseline is not None:
        prefill = baseline.order(prefill, 0)
    first = prefill[0].candidate.worker_id
    decoders = [s for s in ranked if serves_decode_leg(role[s.candidate.worker_id]) and s.candidate.worker_id != first]
    decode = rank_decode(decoders, rng) if baseline is None else baseline.order(decoders, 1)
    if not decode:
        return Plan(False, whole, [], [], None, whole_s)
    # a prefill worker that takes whole requests (or decode legs) has streams of its own to stall
    decodes_there = costs.whole_on is WholeOn.ANY or role[first] != PREFILL
    stall_s = stall_cost(prefill[0], prompt_tokens, block_size, model, costs) if decodes_there else 0.0
    split_s = stall_s + split_cost(prefill[0], decode[0], prompt_tokens, block_size, model, costs, residual_s)
    split = costs.mode is SplitMode.ALWAYS or whole_s is None or split_s < whole_s
    return Plan(split, whole, prefill, decode, split_s, whole_s)


def _whole_workers(
    ranked: Sequence[Scored],
    role: Mapping[str, str],
    prompt_tokens: int,
    block_size: int,
    model: CostModel,
    costs: PdCosts,
) -> list[Scored]:
    """The workers that may serve the request whole, cheapest first by :func:`whole_cost` (its
    TTFT and the stall it puts on the decodes there), so that a long prompt lands where few
    sequences decode; ties keep the decision's order."""
    anywhere = costs.whole_on is WholeOn.ANY
    whole = [s for s in ranked if anywhere or serves_whole(role[s.candidate.worker_id])]
    return sorted(whole, key=lambda s: whole_cost(s, prompt_tokens, block_size, model, costs))


@dataclass(frozen=True)
class Baseline:
    """A baseline policy's order of one leg's workers: round robin (each leg its own turn over its
    workers, by id), or least loaded (by requests; a decode worker by decode load), ties at random."""

    round_robin: bool
    turn: int
    rng: random.Random

    def order(self, scored: Sequence[Scored], leg: int) -> list[Scored]:
        if self.round_robin:
            by_id = sorted(scored, key=lambda s: s.candidate.worker_id)
            start = self.turn % len(by_id) if by_id else 0
            return by_id[start:] + by_id[:start]
        tiebreak = {s.candidate.worker_id: self.rng.random() for s in scored}
        load = decode_load if leg else _requests
        return sorted(scored, key=lambda s: (load(s), tiebreak[s.candidate.worker_id]))


def _requests(scored: Scored) -> int:
    engine = scored.candidate.engine
    return scored.candidate.inflight.requests + (engine.waiting if engine is not None else 0)


def own_tokens(scored: Scored, prompt_tokens: int, block_size: int) -> int:
    """The prompt's tokens that worker would compute (the rest it holds or loads)."""
    return prompt_tokens - predicted_cached_tokens(scored.hit_blocks, prompt_tokens, block_size)


def decodes_running(scored: Scored) -> int:
    """The sequences decoding on that worker now: its engine's running ones, or the requests
    booked there when the engine's report is missing or behind."""
    engine = scored.candidate.engine
    running = engine.running if engine is not None else 0
    return max(running, scored.candidate.inflight.requests)


def whole_cost(scored: Scored, prompt_tokens: int, block_size: int, model: CostModel, costs: PdCosts) -> float:
    """The request served whole there: its TTFT, and its prefill's stall on the decodes there."""
    return scored.cost + stall_cost(scored, prompt_tokens, block_size, model, costs)


def stall_cost(scored: Scored, prompt_tokens: int, block_size: int, model: CostModel, costs: PdCosts) -> float:
    """The prompt's prefill there delays every sequence decoding there by its own time (vLLM
    computes its chunks in the decodes' steps), weighed by ``costs.decode_weight``."""
    prefill_s = model.params(scored.candidate.worker_id).per_token_s * own_tokens(scored, prompt_tokens, block_size)
    return costs.decode_weight * prefill_s * decodes_running(scored)


def split_cost(
    prefill: Scored,
    decode: Scored,
    prompt_tokens: int,
    block_size: int,
    model: CostModel,
    costs: PdCosts,
    residual_s: float = 0.0,
) -> float:
    """The request split: the TTFT on the prefill worker, then its decode leg's."""
    return prefill.cost + decode_leg_s(decode, prompt_tokens, block_size, model, costs) + residual_s


def decode_leg_s(decode: Scored, prompt_tokens: int, block_size: int, model: CostModel, costs: PdCosts) -> float:
    """A decode leg's time to its first byte, predicted: the KV's transfer of what the decode worker
    does not hold, the extra hop, and its first step, which comes after the prefill queued there
    (the decode leg waits in the same queue as whole requests)."""
    transferred = own_tokens(decode, prompt_tokens, block_size)
    ahead = max(decode.prefill_tokens - transferred, 0.0)
    first_step_s = model.params(decode.candidate.worker_id).seconds(ahead)
    return costs.transfer_s(transferred) + costs.hop_ms / 1000 + first_step_s


class DecodeLegs:
    """What decode legs took beyond their prediction, learned from the streamed ones: an
    exponentially weighted mean of (observed - predicted) time to the first byte, per model. The
    transfer's real rate, the hops, the steps a pulled request waits for its KV: what the flags
    cannot know is charged to the next splits' cost. Starts at 0 (the prediction as it is)."""

    def __init__(self, half_life: float = 50.0) -> None:
        self._keep = 0.5 ** (1 / half_life)
        self._residual: dict[str, float] = {}

    def observe(self, model: str, predicted_s: float, observed_s: float) -> None:
        old = self._residual.get(model)
        error = observed_s - predicted_s
        self._residual[model] = error if old is None else self._keep * old + (1 - self._keep) * error

    def residual_s(self, model: str) -> float:
        return self._residual.get(model, 0.0)


def rank_decode(candidates: Sequence[Scored], rng: random.Random) -> list[Scored]:
    """Decode workers best first: not busy, least decode load, most of the prompt held, at random."""
    some_free = not all(s.busy for s in candidates)
    tiebreak = {s.candidate.worker_id: rng.random() for s in candidates}
    return sorted(
        candidates,
        key=lambda s: (
            s.busy and some_free,
            decode_load(s),
            -s.hit_blocks,
            tiebreak[s.candidate.worker_id],
        ),
    )


def decode_load(scored: Scored) -> int:
    """Sequences there now and queued: what a new one shares each decode step with."""
    engine = scored.candidate.engine
    reported = engine.running + engine.waiting if engine is not None else 0
    return max(reported, scored.candidate.inflight.requests)
