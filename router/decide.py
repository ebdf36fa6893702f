"""Routing decisions: the index, the shared load and the scoring, with a degraded fallback.

One decision reads, concurrently, the prompt's match in the index, every replica's in-flight
load, and the "expected" prefixes of recent decisions; it must finish within the Redis budget
(default 50 ms), else the router routes by its own load (round robin over the last workers it
saw alive) and counts it. The index makes routing better, never a request fail.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from redis.exceptions import RedisError

from kvindex.errors import KVIndexError
from kvindex.prefix_memo import PrefixHashMemo
from kvindex.redis_index import RedisIndex
from router.shared_load import InflightLoad, SharedLoad, parse_expected, parse_totals
from kvindex.types import WorkerRecord
from router.fleet import Fleet
from router.scoring import Candidate, Choice, Policy, ScoringWeights, choose, predicted_cached_tokens

log = logging.getLogger(__name__)
REDIS_FAILURES = (RedisError, OSError, TimeoutError, KVIndexError)


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

    @property
    def prompt_blocks(self) -> int:
        return len(self.chain)

    def predicted_cached_tokens(self, candidate: Candidate | None = None) -> int:
        chosen = candidate or self.choice.chosen
        return predicted_cached_tokens(chosen.matched_blocks, self.prompt_tokens, self.block_size)


def _expecting(candidate: Candidate, expected_depth: int) -> Candidate:
    """``candidate`` with the prefix it is expected to hold soon (a recent decision sent it there)
    counted as matched; the part beyond what it holds now is being prefilled there by requests in
    flight, work this prompt shares rather than waits behind (``Candidate.pending_blocks``)."""
    if expected_depth <= candidate.matched_blocks:
        return candidate
    pending = expected_depth - candidate.matched_blocks + candidate.pending_blocks
    return replace(candidate, matched_blocks=expected_depth, pending_blocks=pending)


def _checkpoints(length: int) -> list[int]:
    """Depths checked against expected prefixes: powers of two and the full length."""
    depths = {length} | {1 << k for k in range(length.bit_length()) if 1 << k <= length}
    return sorted(d for d in depths if d > 0)


class Decider:
    def __init__(
        self,
        index: RedisIndex,
        load: SharedLoad,
        fleet: Fleet,
        weights: ScoringWeights,
        policy: Policy,
        redis_timeout_s: float,
        expected_ttl_ms: int,
        unsent: Callable[[str], dict[str, InflightLoad]] = lambda model: {},
    ) -> None:
        self._index = index
        self._load = load
        self._fleet = fleet
        self._weights = weights
        self._policy = policy
        self._timeout = redis_timeout_s
        self._expected_ttl_ms = expected_ttl_ms
        self._unsent = unsent  # this replica's load changes not yet in Redis
        self._turns = itertools.count()
        self._rng = random.Random()
        self.degraded_count = 0
        self.hash_memo = PrefixHashMemo()
        # (model, block hash) -> (worker id, deadline): this replica's own recent choices, seen
        # by its next decisions at once (the shared "expected" entries take a round trip).
        self._recent: dict[tuple[str, int], tuple[str, float]] = {}

    async def decide(self, model: str, tokens: Sequence[int], cache_salt: str | None = None) -> Decision:
        started = time.perf_counter()
        workers = self._fleet.alive(model)
        if not workers:
            raise NoWorkers(f"no alive worker serves model {model!r}")
        block_size = workers[0].block_size
        chain = self.hash_memo.sequence_hashes(tokens, block_size, cache_salt=cache_salt)
        degraded = False
        try:
            async with asyncio.timeout(self._timeout):
                candidates = await self._candidates(model, chain, workers)
            candidates = self._with_recent(model, chain, candidates)
            turn = next(self._turns)
            choice = choose(candidates, len(chain), block_size, self._weights, self._policy, self._rng, turn)
            self._remember(model, chain, choice.chosen.worker_id)
        except REDIS_FAILURES as exc:
            degraded = True
            self.degraded_count += 1
            log.debug("routing %s without Redis (%s): round robin over %d workers", model, exc, len(workers))
            candidates = [Candidate(w.worker_id, w.url, engine=w.load) for w in workers]
            choice = choose(candidates, len(chain), block_size, self._weights, Policy.ROUND_ROBIN, self._rng,
                            next(self._turns))  # fmt: skip
        return Decision(model, len(tokens), block_size, chain, choice, degraded, time.perf_counter() - started)

    def _with_recent(self, model: str, chain: list[int], candidates: list[Candidate]) -> list[Candidate]:
        now = time.monotonic()
        depth: dict[str, int] = defaultdict(int)
        for d in _checkpoints(len(chain)):
            entry = self._recent.get((model, chain[d - 1]))
            if entry is not None and entry[1] > now:
                depth[entry[0]] = max(depth[entry[0]], d)
        if not depth:
            return candidates
        return [_expecting(c, depth[c.worker_id]) for c in candidates]

    def _remember(self, model: str, chain: list[int], worker_id: str) -> None:
        now = time.monotonic()
        deadline = now + self._expected_ttl_ms / 1000
        for d in _checkpoints(len(chain)):
            self._recent[(model, chain[d - 1])] = (worker_id, deadline)
        if len(self._recent) > 100_000:
            self._recent = {k: v for k, v in self._recent.items() if v[1] > now}

    async def _candidates(self, model: str, chain: list[int], workers: list[WorkerRecord]) -> list[Candidate]:
        depths = _checkpoints(len(chain))
        match_reply, totals_reply, expected_reply = await self._index.scripts.call_many([
            self._index.match_call(model, chain),
            self._load.totals_call(model),
            self._load.expected_call(model, [chain[d - 1] for d in depths]),
        ])  # fmt: skip
        for reply in (totals_reply, expected_reply):
            if isinstance(reply, Exception):
                raise reply
        matches = await self._index.match_result(model, match_reply)
        totals = parse_totals(totals_reply)
        for unsent_worker, delta in self._unsent(model).items():
            totals[unsent_worker] = totals.get(unsent_worker, InflightLoad()) + delta
        expected_depth: dict[str, int] = defaultdict(int)
        for depth, worker_id in zip(depths, parse_expected(expected_reply), strict=True):
            if worker_id is not None:
                expected_depth[worker_id] = max(expected_depth[worker_id], depth)
        candidates = [
            Candidate(w.worker_id, w.url, matches.get(w.worker_id, 0), totals.get(w.worker_id, InflightLoad()), w.load)
            for w in workers
        ]
        return [_expecting(c, expected_depth[c.worker_id]) for c in candidates]

    @staticmethod
    def booking(decision: Decision, candidate: Candidate) -> tuple[InflightLoad, list[int]]:
        """What routing ``decision`` to ``candidate`` books: its in-flight load, and the blocks to
        mark "expected" on it (the checkpoints other decisions look up)."""
        uncached = decision.prompt_tokens - decision.predicted_cached_tokens(candidate)
        blocks = [decision.chain[d - 1] for d in _checkpoints(len(decision.chain))]
        return InflightLoad(1, decision.prompt_tokens, uncached), blocks
