"""A routing decision as a value, and what is read off it (issue 56, item 2).

:class:`Decision` is a plain record of what :class:`~router.routing.decide.Decider` decided: the
prompt's size and block hashes, the ranked workers, whether Redis was read. What each later step
needs of it is a pure function here, over the record: the score of a worker, its hit, the cached
tokens predicted there (what the reply's ``x-kvroute-cached-tokens`` says and what the booking
counts as uncached), the prefill queued elsewhere. The accounting of why a prompt missed the cache
is :mod:`router.routing.accounting`'s; the prefixes a booking expects, :mod:`router.routing.expectations`'.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.routing.choice import Choice
from router.routing.scoring import Candidate, Scored
from router.routing.scoring import predicted_cached_tokens as cached_tokens_of


class NoWorkers(Exception):
    """No alive worker serves the model (503)."""


@dataclass(frozen=True)
class Decision:
    model: str
    prompt_tokens: int
    block_size: int
    chain: list[int]
    choice: Choice
    degraded: bool
    seconds: float
    degraded_cause: str | None = None  # "budget", "busy" (no lookup slot in time) or "error"
    turn: int = 0  # its round-robin turn (a split request's legs take their own turns: router.routing.pd)

    @property
    def prompt_blocks(self) -> int:
        return len(self.chain)

    @property
    def candidates(self) -> list[Candidate]:
        """Every alive worker, best first."""
        return [scored.candidate for scored in self.choice.ranked]


def scored_on(decision: Decision, candidate: Candidate) -> Scored:
    """How ``candidate`` scored in this decision."""
    return next(s for s in decision.choice.ranked if s.candidate.worker_id == candidate.worker_id)


def hit_blocks(decision: Decision, candidate: Candidate) -> int:
    """The prompt's blocks predicted to be found cached on ``candidate`` (its score's, else its match)."""
    scored = next((s for s in decision.choice.ranked if s.candidate.worker_id == candidate.worker_id), None)
    return scored.hit_blocks if scored is not None else candidate.matched_blocks


def predicted_cached_tokens(decision: Decision, candidate: Candidate | None = None) -> int:
    """The cached tokens the engine will report on ``candidate`` (default the chosen worker): the
    matched blocks predicted to survive until the prompt is scheduled there
    (:func:`router.routing.scoring.surviving_blocks`)."""
    chosen = candidate or decision.choice.chosen
    return cached_tokens_of(hit_blocks(decision, chosen), decision.prompt_tokens, decision.block_size)


def elsewhere_ahead(decision: Decision, candidate: Candidate) -> float:
    """The prefill queued on the other workers, all of it, as this decision saw it (what the
    queue's price is measured against: router.routing.trade_check)."""
    return sum(s.ahead_tokens for s in decision.choice.ranked if s.candidate.worker_id != candidate.worker_id)
