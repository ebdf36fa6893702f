"""Which worker gets a request: pure functions over what the index and the shared load say.

Cost of sending a prompt of ``P`` blocks to a worker (lower wins), in the spirit of Dynamo's:

    prefill * (P - matched_blocks)           blocks this request would prefill there
  + queued  * queued_prefill_blocks          prefill already booked there (it delays the first token),
                                             less the blocks of this prompt it is computing (shared)
  + active  * inflight_prompt_blocks         KV held by requests in flight there
  + queue   * engine_waiting                 requests its engine already queues

``matched_blocks`` comes from the index (or a fresh "expected" entry); the in-flight figures are
summed over every router replica; ``engine_waiting`` is the engine's own gauge. A worker whose
KV cache is nearly full or whose queue is long is "busy" and is only chosen when all are busy.
Ties are broken at random; with a temperature > 0 the choice is sampled from a softmax over costs.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from kvindex.types import WorkerLoad
from router.shared_load import InflightLoad

NO_LOAD = InflightLoad()


class Policy(StrEnum):
    KV = "kv"
    ROUND_ROBIN = "round_robin"
    RANDOM = "random"
    LEAST_LOADED = "least_loaded"


@dataclass(frozen=True)
class ScoringWeights:
    prefill: float = 1.0
    queued: float = 0.75
    active: float = 0.3
    queue: float = 4.0
    busy_kv_usage: float = 0.97
    busy_waiting: int = 16
    temperature: float = 0.0

    def __post_init__(self) -> None:
        if min(self.prefill, self.queued, self.active, self.queue, self.temperature) < 0:
            raise ValueError("scoring weights and the temperature must be >= 0")
        if not 0 < self.busy_kv_usage <= 1 or self.busy_waiting < 1:
            raise ValueError("busy_kv_usage must be in (0, 1] and busy_waiting >= 1")


@dataclass(frozen=True)
class Candidate:
    worker_id: str
    url: str
    matched_blocks: int = 0
    inflight: InflightLoad = NO_LOAD
    engine: WorkerLoad | None = None
    pending_blocks: int = 0  # of matched_blocks, those requests in flight there are prefilling now


@dataclass(frozen=True)
class Scored:
    candidate: Candidate
    cost: float
    busy: bool


@dataclass(frozen=True)
class Choice:
    ranked: list[Scored]  # best first; the chosen one is ranked[0]

    @property
    def chosen(self) -> Candidate:
        return self.ranked[0].candidate


def predicted_cached_tokens(matched_blocks: int, prompt_tokens: int, block_size: int) -> int:
    """Cached tokens as vLLM counts them: whole blocks, at most prompt length - 1."""
    if prompt_tokens <= 0:
        return 0
    return min(matched_blocks * block_size, (prompt_tokens - 1) // block_size * block_size)


def cost(candidate: Candidate, prompt_blocks: int, block_size: int, weights: ScoringWeights) -> float:
    new_prefill = max(prompt_blocks - candidate.matched_blocks, 0)
    # Prefill queued there delays this prompt, except the part that computes this prompt's own
    # prefix (a burst of one prompt shares that work instead of queueing behind it).
    queued_prefill = max(candidate.inflight.uncached_tokens / block_size - candidate.pending_blocks, 0)
    active = candidate.inflight.prompt_tokens / block_size
    waiting = candidate.engine.waiting if candidate.engine else 0
    return (
        weights.prefill * new_prefill
        + weights.queued * queued_prefill
        + weights.active * active
        + weights.queue * waiting
    )


def is_busy(candidate: Candidate, weights: ScoringWeights) -> bool:
    engine = candidate.engine
    return engine is not None and (engine.kv_usage >= weights.busy_kv_usage or engine.waiting >= weights.busy_waiting)


def _load(candidate: Candidate) -> int:
    return candidate.inflight.requests + (candidate.engine.waiting if candidate.engine else 0)


def choose(
    candidates: Sequence[Candidate],
    prompt_blocks: int,
    block_size: int,
    weights: ScoringWeights,
    policy: Policy = Policy.KV,
    rng: random.Random | None = None,
    turn: int = 0,
) -> Choice:
    """Rank ``candidates`` (non-empty) for a prompt of ``prompt_blocks`` blocks. ``turn`` is the
    round-robin position (the caller's counter)."""
    if not candidates:
        raise ValueError("no candidates to choose from")
    rng = rng or random.Random()
    scored = [Scored(c, cost(c, prompt_blocks, block_size, weights), is_busy(c, weights)) for c in candidates]
    if policy is Policy.ROUND_ROBIN:
        ordered = sorted(scored, key=lambda s: s.candidate.worker_id)
        start = turn % len(ordered)
        return Choice(ordered[start:] + ordered[:start])
    if policy is Policy.RANDOM:
        shuffled = list(scored)
        rng.shuffle(shuffled)
        return Choice(shuffled)
    tiebreak = {s.candidate.worker_id: rng.random() for s in scored}
    if policy is Policy.LEAST_LOADED:
        return Choice(sorted(scored, key=lambda s: (_load(s.candidate), tiebreak[s.candidate.worker_id])))
    ranked = sorted(
        scored, key=lambda s: (s.busy and not all(x.busy for x in scored), s.cost, tiebreak[s.candidate.worker_id])
    )
    if weights.temperature > 0:
        ranked = _sample_first(ranked, weights.temperature, rng)
    return Choice(ranked)


def _sample_first(ranked: list[Scored], temperature: float, rng: random.Random) -> list[Scored]:
    """Move a softmax-sampled candidate (among the non-busy, if any) to the front."""
    pool = [s for s in ranked if not s.busy] or ranked
    best = min(s.cost for s in pool)
    scale = max(max(s.cost for s in pool) - best, 1.0)
    weights = [math.exp(-(s.cost - best) / scale / temperature) for s in pool]
    pick = rng.choices(pool, weights=weights, k=1)[0]
    return [pick, *(s for s in ranked if s is not pick)]
