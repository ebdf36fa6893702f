"""The ranking of the workers for one request, from their scores (:mod:`router.routing.scoring`).

The cost policy ranks by the predicted cost; costs within 5% of the best are ties
(``TIE_WITHIN``), broken for the longest cache hit, then at random weighted by idle time; with a
temperature > 0 the first place is sampled from a softmax. The baseline policies (round robin,
random, least loaded, longest prefix) rank by their own rule over the same scores.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from router.routing.scoring import Candidate, Policy, Scored, ScoringWeights, score
from router.routing.ttft import CostModel

# Costs within this share of the best are ties, broken at random. The learned per-worker rates of
# a fleet of equal engines differ by their noise; taken at face value they send every replica's
# cold prompt in a burst to the same "fastest" idle worker (each replica sees the others' bookings
# only after its decision), where a random pick spreads them. Real differences (a slower GPU,
# a queue, a cached prefix) are larger.
TIE_WITHIN = 0.05
# Ties are drawn with weights by idle time (a shared LRU's eviction, at random): a worker busy a
# moment ago keeps this small weight, and idle times beyond the bound weigh the same.
MIN_IDLE_WEIGHT_S = 0.05
MAX_IDLE_WEIGHT_S = 60.0


@dataclass(frozen=True)
class Choice:
    ranked: list[Scored]  # best first; the chosen one is ranked[0]

    @property
    def chosen(self) -> Candidate:
        return self.ranked[0].candidate


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
    model: CostModel | None = None,
    home_key: int | None = None,
) -> Choice:
    """Rank ``candidates`` (non-empty) for a prompt of ``prompt_blocks`` blocks. ``turn`` is the
    round-robin position (the caller's counter); ``model`` what was learned (a prior without);
    ``home_key`` the hash of the prompt's first block no worker holds: near-ties are drawn by
    rendezvous on it (:func:`rendezvous_draw`) instead of at random."""
    if not candidates:
        raise ValueError("no candidates to choose from")
    rng = rng or random.Random()
    model = model or CostModel()
    scored = [score(c, prompt_blocks, block_size, weights, model) for c in candidates]
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
    some_free = not all(s.busy for s in scored)
    if policy is Policy.PREFIX:
        return Choice(
            sorted(
                scored,
                key=lambda s: (
                    s.busy and some_free,
                    -s.candidate.matched_blocks,
                    _load(s.candidate),
                    tiebreak[s.candidate.worker_id],
                ),
            )
        )
    ranked = sorted(scored, key=lambda s: (s.busy and some_free, s.cost, tiebreak[s.candidate.worker_id]))
    if home_key is not None:
        tiebreak = {s.candidate.worker_id: rendezvous_draw(home_key, s.candidate.worker_id) for s in scored}
    ranked = _near_ties_at_random(ranked, tiebreak)
    if weights.temperature > 0:
        ranked = _sample_first(ranked, weights.temperature, rng)
    return Choice(ranked)


def _near_ties_at_random(ranked: list[Scored], tiebreak: dict[str, float]) -> list[Scored]:
    """Move the candidate that keeps the most of the prompt cached among those whose cost is
    within ``TIE_WITHIN`` of the best (and as busy) to the front; among equal hits, one of those
    with the fewest requests in flight (every replica's, and its engine's queue), drawn at random,
    the longer a worker has been idle the likelier. Ties are equal in the prefill a prompt waits
    for, not in the requests decoding there: where every worker is busy all the time (no idle
    time tells them apart), the fewest in flight spreads the prompts no worker holds, one system
    prompt's home per worker as the longest-prefix router's least-loaded pick does, instead of
    three on one engine's cache and none on another (issue 55: one engine took 4 of 128 requests
    on real vLLM, another 57). When the time is a wash, the cache
    decides: a prompt that leaves its prefix for an equally fast worker duplicates it there and
    evicts that worker's own (on caches of one or two prompts, each such move made the next
    conversation move in turn); and a prompt that evicts anyway had better evict what was used
    longest ago (a shared LRU's choice), not the conversation a worker served a moment ago, whose
    next turn is likely on its way. At random, so that replicas deciding a burst of cold prompts
    at once do not all send theirs to the same worker."""
    best = ranked[0]
    ties = [s for s in ranked if s.busy == best.busy and s.cost <= best.cost * (1 + TIE_WITHIN)]
    most = max(s.hit_blocks for s in ties)
    kept = [s for s in ties if s.hit_blocks == most]
    fewest = min(_load(s.candidate) for s in kept)
    kept = [s for s in kept if _load(s.candidate) == fewest]
    # a weighted draw from one uniform number each (the largest u ** (1 / weight) wins with
    # probability in proportion to its weight)
    pick = max(kept, key=lambda s: tiebreak[s.candidate.worker_id] ** (1 / _idle_weight(s.candidate)))
    return ranked if pick is best else [pick, *(s for s in ranked if s is not pick)]


def rendezvous_draw(key: int, worker_id: str) -> float:
    """A uniform number in (0, 1) fixed by (``key``, ``worker_id``), the same in every process:
    with it the near-ties' weighted draw is weighted rendezvous hashing. Every replica, deciding
    alone, sends the prompts whose uncached part starts with the same block (one system prompt's
    new conversations, arriving at several replicas at once, or again after it was evicted
    everywhere) to the same worker among equals, a home that keeps them together; prompts that
    differ there spread over the workers as a random draw would, each worker with its weight's
    share. (Python's own ``hash`` of a string differs from process to process.)"""
    digest = xxhash.xxh64_intdigest(f"{key}:{worker_id}".encode())
    return (digest + 0.5) / 2.0**64


def _idle_weight(candidate: Candidate) -> float:
    """A tie's weight in the draw: its idle time, bounded (never seen busy: the bound)."""
    idle = MAX_IDLE_WEIGHT_S if candidate.idle_s is None else min(candidate.idle_s, MAX_IDLE_WEIGHT_S)
    return idle + MIN_IDLE_WEIGHT_S


def _sample_first(ranked: list[Scored], temperature: float, rng: random.Random) -> list[Scored]:
    """Move a softmax-sampled candidate (among the non-busy, if any) to the front."""
    pool = [s for s in ranked if not s.busy] or ranked
    best = min(s.cost for s in pool)
    scale = (max(s.cost for s in pool) - best) or 1.0  # costs are seconds: normalise by their spread
    weights = [math.exp(-(s.cost - best) / scale / temperature) for s in pool]
    pick = rng.choices(pool, weights=weights, k=1)[0]
    return [pick, *(s for s in ranked if s is not pick)]
