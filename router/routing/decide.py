"""Routing decisions: the index, the shared load and the scoring, with a degraded fallback.

One decision reads, concurrently, the prompt's match in the index, every replica's in-flight
load, and the "expected" prefixes of recent decisions; it must finish within the Redis budget
(default 50 ms), else the router routes by its own load (round robin over the last workers it
saw alive) and counts it, leaving the command to finish (:mod:`router.routing.lookups`: cancelling it
would cost its connection). The index makes routing better, never a request fail.
"""

from __future__ import annotations

import logging
import random
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace

from kvindex.errors import REDIS_FAILURES
from kvindex.prefix_memo import PrefixHashMemo
from kvindex.routing_index import IndexView, RoutingIndex
from kvindex.shared_load import InflightLoad
from kvindex.tiers import LOWER_TIERS, tier_holder
from kvindex.types import WorkerRecord
from router.prompts.hashing import PromptHasher
from router.routing.activity import WorkerActivity
from router.routing.choice import choose
from router.routing.decision import Decision, NoWorkers
from router.routing.expectations import checkpoints
from router.routing.fleet import Fleet
from router.routing.hybrid import hybrid_matches
from router.routing.lookups import BudgetExpired, Lookups
from router.routing.pd import DecodeLegs
from router.routing.scoring import (
    Candidate,
    Policy,
    ScoringWeights,
    busy_share,
)
from router.routing.ttft import TtftLearner
from router.shared.replica_load import ReplicaLoad

log = logging.getLogger("router.decide")  # the name it always had: log filters rely on it


def _expecting(candidate: Candidate, expected_depth: int) -> Candidate:
    """``candidate`` with the prefix a request in flight there computes or holds (an expectation
    lasts as long as its request): held, it is pinned there (``Candidate.held_blocks``, which no
    eviction takes); beyond what the index lists, it is being prefilled there, work this prompt
    shares rather than waits behind (``Candidate.pending_blocks``)."""
    held = max(candidate.held_blocks, expected_depth)
    if expected_depth <= candidate.matched_blocks:
        return replace(candidate, held_blocks=held) if held != candidate.held_blocks else candidate
    pending = expected_depth - candidate.matched_blocks + candidate.pending_blocks
    return replace(candidate, matched_blocks=expected_depth, pending_blocks=pending, held_blocks=held)


def home_key(chain: Sequence[int], candidates: Sequence[Candidate]) -> int | None:
    """The hash of the prompt's first block that no candidate holds (its last block's when one
    holds them all; None for a prompt of no whole block): what the rendezvous among equally good
    workers is drawn on (:func:`router.routing.choice.rendezvous_draw`)."""
    if not chain:
        return None
    best = max((c.matched_blocks for c in candidates), default=0)
    return chain[min(best, len(chain) - 1)]


class Decider:
    """Decisions for one replica. Pure of side effects on routing state: what a decision books
    (load, expected prefixes) is booked by the request's :class:`~router.routing.booking.Booking`."""

    def __init__(
        self,
        index: RoutingIndex,
        replica_load: ReplicaLoad,
        fleet: Fleet,
        weights: ScoringWeights,
        policy: Policy,
        redis_timeout_s: float,
        lookup_slots: int = 29,
        backstop_s: float = 2.0,
    ) -> None:
        self._index = index
        self._replica_load = replica_load
        self._fleet = fleet
        self._weights = weights
        self._policy = policy
        self._timeout = redis_timeout_s
        # no task per lookup where cancelling one is free (a single server's pipelined connection)
        self.lookups = Lookups(lookup_slots, redis_timeout_s, backstop_s, index.cancel_safe)
        self._turn = 0  # round robin's next turn
        self._rng = random.Random()
        self.degraded_count = 0
        self.degraded = False  # in degraded mode now: the last decision could not use Redis
        self.hash_memo = PrefixHashMemo()
        self.hasher = PromptHasher(self.hash_memo)
        self.learners: dict[str, TtftLearner] = {}  # per model (router.routing.model_sync shares them)
        self.activity = WorkerActivity()  # when each worker was last seen busy (ties among equals)
        self.decode_legs = DecodeLegs()  # what split requests' decode legs took beyond the prediction

    def learner_for(self, model: str) -> TtftLearner:
        """What this replica learned of ``model``'s engines (a new one starts from the priors)."""
        learner = self.learners.get(model)
        if learner is None:
            priors = {tier: self._weights.tiers.load_s_per_token(tier) for tier in LOWER_TIERS}
            learner = self.learners[model] = TtftLearner(tier_priors=priors)
        return learner

    async def decide(
        self,
        model: str,
        tokens: Sequence[int],
        cache_salt: str | None = None,
        dry_run: bool = False,
        adapter: str | None = None,
    ) -> Decision:
        """The decision for this prompt now. ``dry_run`` (``/debug/route``): the same answer the next
        real decision would give, changing nothing: no round-robin turn or random draw is used up,
        degraded mode is neither entered nor left. ``adapter``: the LoRA adapter the request names
        (only workers that serve it, and the prompt hashed with its name, as vLLM does)."""
        started = time.perf_counter()
        turn = self._turn
        rng = self._rng
        if dry_run:
            rng = random.Random()
            rng.setstate(self._rng.getstate())
        else:
            self._turn += 1
        workers = self._fleet.alive(model, adapter)
        if not workers:
            raise NoWorkers(f"no alive worker serves model {adapter or model!r}")
        block_size = workers[0].block_size
        chain = await self.hasher.chain(tokens, block_size, cache_salt, adapter)  # long prompts: in slices
        try:
            view = await self.lookups.run(lambda: self._lookup(model, chain, len(tokens), block_size))
        except REDIS_FAILURES as exc:
            if not dry_run:
                self._enter_degraded(exc)
            cause = ("busy" if exc.busy else "budget") if isinstance(exc, BudgetExpired) else "error"
            candidates = [Candidate(w.worker_id, w.url, engine=w.load) for w in workers]
            choice = choose(candidates, len(chain), block_size, self._weights, Policy.ROUND_ROBIN, rng, turn)
            seconds = time.perf_counter() - started
            return Decision(model, len(tokens), block_size, chain, choice, True, seconds, cause, turn)
        if not dry_run:
            self._leave_degraded()
        candidates = self._with_recent(model, chain, self._candidates(model, view, workers))
        if self._policy is Policy.KV:
            candidates = self.activity.note(candidates, record=not dry_run)
        learner = self.learner_for(model)
        if not dry_run:
            learner.note_busy(busy_share(candidates))
        home = home_key(chain, candidates)
        choice = choose(candidates, len(chain), block_size, self._weights, self._policy, rng, turn, learner.model, home)
        return Decision(model, len(tokens), block_size, chain, choice, False, time.perf_counter() - started, turn=turn)

    def _enter_degraded(self, exc: BaseException) -> None:
        self.degraded_count += 1
        if not self.degraded:
            self.degraded = True
            why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            log.warning(
                "degraded mode: Redis did not answer within %.0f ms (%s); routing by round robin over the "
                "last known workers until it does",
                self._timeout * 1000,
                why,
            )

    def _leave_degraded(self) -> None:
        if self.degraded:
            self.degraded = False
            log.info(
                "degraded mode over: Redis answers again; routing by the index (%d degraded decisions so far)",
                self.degraded_count,
            )

    def _with_recent(self, model: str, chain: list[int], candidates: list[Candidate]) -> list[Candidate]:
        """Candidates with the prefixes this replica's own requests in flight expect on them."""
        depth: dict[str, int] = defaultdict(int)
        for d in checkpoints(len(chain)):
            worker_id = self._replica_load.expected_worker(model, chain[d - 1])
            if worker_id is not None:
                depth[worker_id] = max(depth[worker_id], d)
        if not depth:
            return candidates
        return [_expecting(c, depth[c.worker_id]) for c in candidates]

    async def _lookup(self, model: str, chain: list[int], prompt_tokens: int, block_size: int) -> IndexView:
        """What the index and the shared state say of this prompt: one lookup through the routing port
        (run within the budget by :mod:`router.routing.lookups`; on Redis one pipelined round trip that
        carries this replica's pending load changes), and for a hybrid model one more for its window
        groups' blocks (router.routing.hybrid)."""
        view = await self._index.lookup(model, chain, checkpoints(len(chain)), carrier=self._replica_load)
        groups = self._fleet.kv_groups(model)
        if groups:
            hits = await hybrid_matches(self._index, model, groups, chain, prompt_tokens, block_size, view.matches)
            view = IndexView(hits, view.totals, view.expected_depth)
        return view

    def _candidates(self, model: str, view: IndexView, workers: list[WorkerRecord]) -> list[Candidate]:
        """The workers as Redis sees them (the other replicas' load), plus this replica's own
        load from its local truth. Read here, with no await between it and the booking of this
        decision: a burst decided together must each see the ones just before it, or they herd
        onto one worker."""
        totals = dict(view.totals)
        # This replica's own load from its local truth, not from Redis: a decision reading Redis
        # while a flush lands could count a change twice or not at all (a released prefill still
        # booked, say), and move a conversation off its worker.
        for own_worker, load in self._replica_load.inflight(model).items():
            totals[own_worker] = totals.get(own_worker, InflightLoad()) + load
        matches = view.matches
        tiered = self._fleet.tiered(model)  # most fleets have none: no tier holder's id to look up
        candidates = [
            Candidate(
                w.worker_id,
                w.url,
                matches.get(w.worker_id, 0),
                totals.get(w.worker_id, InflightLoad()),
                w.load,
                cached_blocks=w.blocks,
                # its lower tiers' depths: their holders match beside it (kvindex/tiers.py)
                tier_depths=tuple(matches.get(tier_holder(w.worker_id, t), 0) for t in LOWER_TIERS) if tiered else (),
            )
            for w in workers
        ]
        if not view.expected_depth:
            return candidates
        return [_expecting(c, view.expected_depth.get(c.worker_id, 0)) for c in candidates]
