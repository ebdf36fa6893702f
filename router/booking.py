"""One request's load on the workers it is sent to, from the first attempt to the last byte.

The single owner of a request's load lifecycle:

1. :meth:`Booking.attempt` before each try on a worker: its in-flight load (one request, its
   prompt tokens, its uncached tokens) is booked on that worker, and the prompt's checkpoint
   blocks are marked "expected" there: this replica sees them at once, until the first byte (or
   the failure) and the index's lag after it; the others see them through Redis, for twice the
   predicted TTFT plus that lag (what the index needs to get them).
2. :meth:`Booking.prefilled` when the worker's reply starts (for a stream, the first token): the
   uncached tokens no longer queue ahead of other prompts on that worker, this replica's
   expectation ends after the index's lag, and the time it took teaches the TTFT model
   (:mod:`router.ttft`). A non-streamed reply's first byte comes only after
   its last token, so its prefill is released when it is predicted to be done instead; its time
   teaches the model once :meth:`Booking.replied` says how many tokens the reply decoded.
3. :meth:`Booking.failed` when a try fails before its first byte: that worker's load is released
   and its expectation ended (the retry books the next worker).
4. :meth:`Booking.close` when the request ends, however it ends: whatever is still booked is
   released, and an expectation still standing ends. Used as a context manager, so no path can
   forget it.
"""

from __future__ import annotations

import asyncio
import time
from types import TracebackType

from router.decide import Decision
from router.load import ReplicaLoad
from router.scoring import Candidate
from router.shared_load import InflightLoad
from router.ttft import TtftLearner

# An expectation stands in for blocks a prefill is computing, until the engine's KV events put
# them in the index: past that it is a promise of blocks the worker's full cache may have evicted
# since (kept a fixed 2 s, on a tight cache, it made most of the prefix tokens the index promised
# and the engines did not have: docs/router.md). The replica that booked it ends it once the first
# byte is seen, after the index's lag, for every replica (settle.lua): the others cannot see that
# byte, and a deadline guessed for them (twice the predicted TTFT, tried) ended it early wherever
# a queue grew longer than predicted, so that four replicas duplicated prefixes one did not.
INDEX_LAG_S = 0.2  # engine step -> KV event -> agent -> Redis: milliseconds; generous for a busy agent


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
        # worker id -> when its expectation lapses (monotonic), once settled; unsettled: at most its TTL
        self._settled_at: dict[str, float] = {}
        # A whole reply's (prefill tokens waited for, seconds), learned from once its length is known.
        self._whole: dict[str, tuple[float, float]] = {}

    @property
    def held(self) -> dict[str, InflightLoad]:
        """What is booked now, per worker (a copy)."""
        return dict(self._held)

    def attempt(self, candidate: Candidate) -> None:
        decision = self._decision
        uncached = decision.prompt_tokens - decision.predicted_cached_tokens(candidate)
        load = InflightLoad(1, decision.prompt_tokens, uncached)
        self._release(candidate.worker_id)  # a second try on the same worker books once
        self._load.book(decision.model, candidate.worker_id, load, decision.expected_blocks())
        self._load.hold(decision.model, candidate.worker_id, decision.expected_blocks())
        self._held[candidate.worker_id] = load
        self._sent_at[candidate.worker_id] = time.perf_counter()
        if self._learner is not None:
            self._learner.note_request(uncached)
        if not self._streamed and uncached:
            self._cancel_timer()
            predicted_ttft_s = decision.scored(candidate).ttft_s
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(
                predicted_ttft_s, self._predicted_prefilled, candidate.worker_id, predicted_ttft_s
            )

    def prefilled(self, candidate: Candidate) -> None:
        """The reply's first byte arrived."""
        sent_at = self._sent_at.get(candidate.worker_id)
        if self._learner is not None and sent_at is not None:
            waited = self._decision.scored(candidate).prefill_tokens
            seconds = time.perf_counter() - sent_at
            if self._streamed:
                self._learner.observe(candidate.worker_id, waited, seconds)
            else:
                self._whole[candidate.worker_id] = (waited, seconds)
        self._settle(candidate.worker_id, INDEX_LAG_S)
        self._release_prefill(candidate.worker_id)

    def replied(self, candidate: Candidate, usage: dict | None) -> None:
        """The reply ended with ``usage`` (None: not reported): a whole reply teaches the TTFT
        model with its completion tokens, so that their decode is learned apart from the prefill."""
        whole = self._whole.pop(candidate.worker_id, None)
        completion = (usage or {}).get("completion_tokens")
        if self._learner is not None and whole is not None and isinstance(completion, int):
            waited, seconds = whole
            self._learner.observe(candidate.worker_id, waited, seconds, whole_reply=True, completion_tokens=completion)

    def _predicted_prefilled(self, worker_id: str, predicted_ttft_s: float) -> None:
        """A whole reply's prefill is predicted done: its booked prefill is released, and its
        expectation ends after as long again (a queue longer than predicted) and the index's lag."""
        self._settle(worker_id, predicted_ttft_s + INDEX_LAG_S)
        self._release_prefill(worker_id)

    def _release_prefill(self, worker_id: str) -> None:
        held = self._held.get(worker_id)
        if held is None or not held.uncached_tokens:
            return
        done = InflightLoad(0, 0, held.uncached_tokens)
        self._load.release(self._decision.model, worker_id, done)
        self._held[worker_id] = held + (-done)

    def failed(self, candidate: Candidate) -> None:
        self._cancel_timer()
        self._settle(candidate.worker_id, 0.0)
        self._release(candidate.worker_id)

    def _settle(self, worker_id: str, within_s: float) -> None:
        decision = self._decision
        self._settled_at[worker_id] = time.monotonic() + within_s
        self._load.settle_expected(decision.model, worker_id, decision.expected_blocks(), within_s)

    def close(self) -> None:
        """The request ended: what is booked is released, and its expectation ends now wherever it
        still stands. Its blocks reached the index with its prefill, a step or more before its
        last token; standing longer, it hid from every decision what later requests there evicted
        (on caches of one or two prompts, whole-checkpoint predictions where the engine had
        nothing: docs/router.md)."""
        self._cancel_timer()
        now = time.monotonic()
        for worker_id in list(self._held):
            if self._settled_at.get(worker_id, now + 1.0) > now:
                self._settle(worker_id, 0.0)
            self._release(worker_id)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _release(self, worker_id: str) -> None:
        held = self._held.pop(worker_id, None)
        if held is not None:
            self._load.release(self._decision.model, worker_id, held)
            self._load.unhold(self._decision.model, worker_id, self._decision.expected_blocks())

    def __enter__(self) -> Booking:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()
