"""One request's load on the workers it is sent to, from the first attempt to the last byte.

The single owner of a request's load lifecycle:

1. :meth:`Booking.attempt` before each try on a worker: its in-flight load (one request, its
   prompt tokens, its uncached tokens) is booked on that worker, and the prompt's checkpoint
   blocks are marked "expected" there, for this replica at once and for the others through
   Redis, for as long as the request is in flight: first the blocks its prefill computes (a
   burst of one prompt shares that work), then the blocks it holds (a running request's blocks
   cannot be evicted, so a prompt sharing them keeps them wherever the cache is full).
2. :meth:`Booking.prefilled` when the worker's reply starts (for a stream, the first token): the
   uncached tokens no longer queue ahead of other prompts on that worker, and the time it took
   teaches the TTFT model (:mod:`router.routing.ttft`). A non-streamed reply's first byte comes only after
   its last token, so its prefill is released when it is predicted to be done instead; its time
   teaches the model once :meth:`Booking.replied` says how many tokens the reply decoded.
3. :meth:`Booking.failed` when a try fails before its first byte: that worker's load is released
   and its expectation ended (the retry books the next worker).
4. :meth:`Booking.close` when the request ends, however it ends: whatever is still booked is
   released and its expectation ends, for every replica: from then on the index alone says what
   the worker holds (an expectation that outlived its request hid what later requests evicted).
   Used as a context manager, so no path can forget it.
"""

from __future__ import annotations

import asyncio
import time
from types import TracebackType

from kvindex.shared_load import InflightLoad
from router.routing.decision import Decision, elsewhere_ahead, predicted_cached_tokens, scored_on
from router.routing.expectations import expected_blocks
from router.routing.scoring import Candidate
from router.routing.ttft import TtftLearner
from router.shared.replica_load import ReplicaLoad

# An expectation stands in for the blocks a request computes and then holds on its worker. Past
# the request it is a promise of blocks the worker's full cache may have evicted since (kept a
# fixed 2 s, on a tight cache, it made most of the prefix tokens the index promised and the
# engines did not have; ended at the first byte plus the index's lag, the other replicas lost
# sight of prefixes still pinned there: docs/router.md). The replica that booked it ends it when
# the request ends, for every replica (settle.lua): the others cannot see that end.


class Booking:
    def __init__(
        self, decision: Decision, load: ReplicaLoad, learner: TtftLearner | None = None, streamed: bool = True
    ) -> None:
        self._decision = decision
        self._load = load
        self._learner = learner
        self._streamed = streamed
        self._held: dict[str, InflightLoad] = {}  # worker id -> what is booked there now
        self._sent_at: dict[str, float] = {}  # worker id -> when the try started
        self._timer: asyncio.TimerHandle | None = None
        # A whole reply's (prefill tokens waited for, their attention work, seconds), learned from
        # once its length is known.
        self._whole: dict[str, tuple[float, float, float]] = {}
        self._first_byte_s: dict[str, float] = {}  # worker id -> the seconds to its first byte

    @property
    def held(self) -> dict[str, InflightLoad]:
        """What is booked now, per worker (a copy)."""
        return dict(self._held)

    def attempt(self, candidate: Candidate, uncached: int | None = None) -> None:
        """``uncached``: the tokens it will compute, when not the prompt's tokens less its cached
        ones (a split request's decode leg loads the prompt's KV and computes next to nothing)."""
        decision = self._decision
        if uncached is None:
            uncached = decision.prompt_tokens - predicted_cached_tokens(decision, candidate)
        attention = round(scored_on(decision, candidate).own_attention)
        load = InflightLoad(1, decision.prompt_tokens, uncached, attention)
        self._release(candidate.worker_id)  # a second try on the same worker books once
        self._load.book(decision.model, candidate.worker_id, load, expected_blocks(decision.chain))
        self._held[candidate.worker_id] = load
        self._sent_at[candidate.worker_id] = time.perf_counter()
        if self._learner is not None:
            self._learner.note_request(uncached)
        if not self._streamed and uncached:
            self._cancel_timer()
            predicted_ttft_s = scored_on(decision, candidate).ttft_s
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(predicted_ttft_s, self._release_prefill, candidate.worker_id)

    def prefilled(self, candidate: Candidate) -> None:
        """The reply's first byte arrived."""
        sent_at = self._sent_at.get(candidate.worker_id)
        if self._learner is not None and sent_at is not None:
            scored = scored_on(self._decision, candidate)
            waited, attention = scored.prefill_tokens, scored.attention
            seconds = time.perf_counter() - sent_at
            self._first_byte_s[candidate.worker_id] = seconds
            if self._streamed:
                load = scored.single_tier_load
                loaded = (load[0], load[1] * self._decision.block_size) if load else None
                self._learner.observe(candidate.worker_id, waited, seconds, attention=attention, loaded=loaded)
            else:
                self._whole[candidate.worker_id] = (waited, attention, seconds)
        self._release_prefill(candidate.worker_id)

    def replied(self, candidate: Candidate, usage: dict | None) -> None:
        """The reply ended with ``usage`` (None: not reported): a whole reply teaches the TTFT
        model with its completion tokens, so that their decode is learned apart from the prefill;
        every reply whose engine said what it computed measures the queue's price
        (:mod:`router.routing.trade_check`)."""
        whole = self._whole.pop(candidate.worker_id, None)
        completion = (usage or {}).get("completion_tokens")
        first_byte_s = self._first_byte_s.pop(candidate.worker_id, None)
        if self._learner is not None and first_byte_s is not None:
            self._observe_trade(candidate, usage, first_byte_s if whole is None else whole[2], completion)
        if self._learner is not None and whole is not None and isinstance(completion, int):
            waited, attention, seconds = whole
            self._learner.observe(
                candidate.worker_id,
                waited,
                seconds,
                whole_reply=True,
                completion_tokens=completion,
                attention=attention,
            )

    def _observe_trade(self, candidate: Candidate, usage: dict | None, seconds: float, completion: object) -> None:
        usage = usage or {}
        prompt = usage.get("prompt_tokens")
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if not isinstance(prompt, int) or not isinstance(cached, int) or self._learner is None:
            return
        output = completion if isinstance(completion, int) and not self._streamed else 0
        decision = self._decision
        ahead = scored_on(decision, candidate).ahead_tokens
        self._learner.observe_trade(prompt - cached, ahead, elsewhere_ahead(decision, candidate), output, seconds)

    def _release_prefill(self, worker_id: str) -> None:
        held = self._held.get(worker_id)
        if held is None or not (held.uncached_tokens or held.attention):
            return
        done = InflightLoad(0, 0, held.uncached_tokens, held.attention)
        self._load.release(self._decision.model, worker_id, done)
        self._held[worker_id] = held + (-done)

    def failed(self, candidate: Candidate) -> None:
        self._cancel_timer()
        self._settle(candidate.worker_id)
        self._release(candidate.worker_id)

    def _settle(self, worker_id: str) -> None:
        decision = self._decision
        self._load.settle_expected(decision.model, worker_id, expected_blocks(decision.chain), 0.0)

    def close(self) -> None:
        self._cancel_timer()
        for worker_id in list(self._held):
            self._settle(worker_id)
            self._release(worker_id)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _release(self, worker_id: str) -> None:
        held = self._held.pop(worker_id, None)
        if held is not None:
            self._load.release(self._decision.model, worker_id, held)

    def __enter__(self) -> Booking:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()
