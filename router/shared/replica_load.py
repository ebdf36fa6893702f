"""This replica's in-flight requests per worker: the local truth behind its shared load.

Every booking and release is also sent to Redis (HINCRBY, via :class:`~kvindex.shared_load.SharedLoad`)
within :data:`FLUSH_WINDOW_S`: carried by this replica's next decision's own batch, or flushed;
every second the lease is renewed with a full snapshot of this truth, which heals any update that
was lost while Redis was unreachable. A replica alone on a model writes only the snapshots there.
On shutdown the replica leaves, and its load with it.

A booking may also mark blocks "expected" on its worker (the worker will hold them once this
request's prefill is done): written to Redis for the other replicas, and kept here so that this
replica's own next decisions see them at once, without waiting for the write's round trip.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from kvindex.errors import REDIS_FAILURES
from kvindex.routing_index import LoadDeltas, SharedState
from kvindex.shared_load import Expectation, InflightLoad

log = logging.getLogger("router.load")  # the name it always had: log filters rely on it
# Changes are gathered this long before they are written, unless a decision's own lookup batch
# carries them sooner (:meth:`ReplicaLoad.carry`: then no flush is written at all). The window is
# how stale the other replicas' view of this replica's load is: a prefill released at its first
# byte still counts as queued ahead for them until it is written. At 10 ms, with 4 replicas on the
# regimes grid's Zipf cells, that stale queue moved 1.5-2x as many prompts off their caches as one
# replica did (up to 7% of the cacheable tokens) and cost 1-4 points of hit rate against 2 ms
# (docs/benchmarks-history.md, "Runs of 2026-12-01, fourth session"). The price: about one flush per request
# at moderate rates (~0.3-0.5 ms of router CPU each on the 2-core benchmark machine); at high rates
# the decisions' batches carry nearly every change and few flushes remain.
FLUSH_WINDOW_S = 0.002
# On a Redis Cluster no decision carries the changes (its lookups are not pipelined), so every
# window is a flush of its own, one pipeline per shard: at 2 ms they took enough of the node's
# connections under a paused shard to push decisions into degraded mode (1 in 7 runs of
# test_a_briefly_paused_control_shard_degrades_no_decision under CPU load, 0 in 10 at 10 ms).
UNCARRIED_FLUSH_WINDOW_S = 0.010
# A replica alone on a model (its last lease found no other) writes none of its changes there: no
# one reads them. It renews every ALONE_RENEWAL_S instead of every third of its lease, so its
# snapshots keep its hash that close to the truth, and a replica that starts is found that soon:
# the renewal that finds it writes the lone one's whole load, and the changes flow again, each
# within the window. At 100 requests/s a flush per request was ~8% of a lone router's CPU, and
# gathering them in longer windows made the requests that met a large flush wait behind it
# (docs/benchmarks-history.md, run 13).
ALONE_RENEWAL_S = 0.1


class ReplicaLoad:
    def __init__(
        self,
        shared: SharedState,
        lease_ttl_ms: int,
        expected_ttl_ms: int = 2_000,
        write_timeout_s: float = 2.0,
        flush_window_s: float = FLUSH_WINDOW_S,
        alone_renewal_s: float = ALONE_RENEWAL_S,
    ) -> None:
        self.shared = shared
        self._ttl_ms = lease_ttl_ms
        self._expected_ttl_ms = expected_ttl_ms
        # A write is cut off only past this (the socket timeout): cancelling a command on the wire
        # costs its connection, so a Redis slower than the renewal period must not make every
        # renewal and flush reconnect (router/routing/lookups.py says the same of decisions).
        self._write_timeout_s = write_timeout_s
        self.flush_window_s = flush_window_s
        self._alone_renewal_s = alone_renewal_s
        self._local: dict[str, dict[str, InflightLoad]] = defaultdict(lambda: defaultdict(InflightLoad))
        self._task: asyncio.Task[None] | None = None
        # Changes not yet sent: flushed together every few milliseconds, so that Redis sees one
        # pipeline per burst instead of several commands per request.
        self._deltas: dict[tuple[str, str], InflightLoad] = defaultdict(InflightLoad)
        self._expects: list[Expectation] = []
        # Armed by the first change not yet written: the flush is due when it fires (cancelled when
        # a decision's batch carries every pending change before).
        self._flush_due: asyncio.TimerHandle | None = None
        self._dirty = asyncio.Event()  # a flush is due now
        # One writer at a time: a lease snapshot must not overlap a flush of changes it includes.
        self._writing = asyncio.Lock()
        # Batches (decisions' lookups) carrying changes, whose replies are not read yet: a lease
        # snapshot waits for them (it includes their changes), and none starts while it is taken.
        self._carrying = 0
        self._none_carried = asyncio.Event()
        self._none_carried.set()
        self.flushes = 0  # flush round trips written (a carried change needs none)
        self._flusher: asyncio.Task[None] | None = None
        self._leased: set[str] = set()  # models this replica holds a lease for
        # (model, block hash) -> (worker id, monotonic deadline): this replica's own expectations.
        self._recent: dict[tuple[str, int], tuple[str, float]] = {}

    def book(self, model: str, worker_id: str, load: InflightLoad, expected: Sequence[int] = ()) -> None:
        """Book ``load`` on ``worker_id``, and mark ``expected`` blocks there until
        :meth:`settle_expected` (for every replica: the others through Redis), at most the
        configured expected TTL."""
        self._change(model, worker_id, load)
        if expected:
            if not self.shared.alone(model):
                self._expects.append(Expectation(model, worker_id, list(expected), self._expected_ttl_ms))
            self._remember(model, worker_id, expected)

    def _remember(self, model: str, worker_id: str, blocks: Sequence[int]) -> None:
        now = time.monotonic()
        deadline = now + self._expected_ttl_ms / 1000
        for block in blocks:
            self._recent[(model, block)] = (worker_id, deadline)
        if len(self._recent) > 100_000:  # bounded: expired entries go first
            self._recent = {k: v for k, v in self._recent.items() if v[1] > now}

    def settle_expected(self, model: str, worker_id: str, blocks: Sequence[int], within_s: float) -> None:
        """The request that was to put ``blocks`` on ``worker_id`` is past its prefill (or failed):
        this replica's expectation of them there ends within ``within_s``, the time the engine's
        KV events take to reach the index. After that the index alone says whether the worker
        holds them; an expectation outliving it would promise blocks that the worker's full cache
        may have evicted since. The other replicas' copy in Redis ends with it (settle.lua, in
        the next batch), so that every replica stops expecting them when this one does."""
        deadline = time.monotonic() + within_s
        for block in blocks:
            entry = self._recent.get((model, block))
            if entry is not None and entry[0] == worker_id and entry[1] > deadline:
                self._recent[(model, block)] = (worker_id, deadline)
        if blocks and not self.shared.alone(model):
            self._expects.append(Expectation(model, worker_id, list(blocks), math.ceil(within_s * 1000), settled=True))
            self._changed()

    def expected_worker(self, model: str, block: int) -> str | None:
        """The worker this replica recently sent a prompt with ``block`` to, while that is fresh."""
        entry = self._recent.get((model, block))
        return entry[0] if entry is not None and entry[1] > time.monotonic() else None

    def release(self, model: str, worker_id: str, load: InflightLoad) -> None:
        self._change(model, worker_id, -load)

    def _change(self, model: str, worker_id: str, delta: InflightLoad) -> None:
        """Apply ``delta`` to the local truth at once and queue it for Redis."""
        local = self._local[model]
        local[worker_id] = local[worker_id] + delta
        if local[worker_id] == InflightLoad():
            del local[worker_id]
        if self.shared.alone(model):
            return  # no one reads it: the next lease snapshot writes it
        self._deltas[(model, worker_id)] = self._deltas[(model, worker_id)] + delta
        self._changed()

    def _changed(self) -> None:
        """A change is pending: it is written within the flush window (gathering what arrives
        meanwhile), by a decision's batch that carries it or else by the flush."""
        if self._flush_due is None:
            self._flush_due = asyncio.get_running_loop().call_later(self.flush_window_s, self.flush_now)

    def flush_now(self) -> None:
        """Write the pending changes now, without waiting for the window."""
        if self._flush_due is not None:
            self._flush_due.cancel()
        self._flush_due = None
        self._dirty.set()

    def _take(self, leased_only: bool) -> tuple[dict[tuple[str, str], InflightLoad], list[Expectation]]:
        """The pending changes (those of models without a lease yet stay, when ``leased_only``),
        no longer pending: the caller writes them. No flush is due once none is left."""
        taken = {k: v for k, v in self._deltas.items() if not leased_only or k[0] in self._leased}
        for key in taken:
            del self._deltas[key]
        expects, self._expects = self._expects, []
        if not self._deltas and self._flush_due is not None:
            self._flush_due.cancel()
            self._flush_due = None
        return {k: v for k, v in taken.items() if v != InflightLoad()}, expects

    def carry(self) -> tuple[LoadDeltas, list[Expectation]] | None:
        """The pending changes for a batch about to be written (a decision's lookup on the
        pipelined connection, whose replies are read even if its caller stops waiting), now being
        written: the batch's writer calls :meth:`carried` once its replies are read or lost (the
        routing port's LoadCarrier). None while a lease snapshot or flush is being written (they go
        to the next one), for a model with no lease yet (its first snapshot is the flush's), and
        when nothing is pending."""
        if self._writing.locked() or (not self._deltas and not self._expects):
            return None
        deltas, expects = self._take(leased_only=True)
        if not deltas and not any(e.blocks for e in expects):
            return None
        self._carrying += 1
        self._none_carried.clear()
        return deltas, expects

    def carried(self, replies: Sequence[Any] | None) -> None:
        """The batch of a :meth:`carry` is done: its replies (None: lost, or not waited for).
        Lost changes are healed by the next lease snapshot, as a flush's are."""
        for reply in replies or ():
            if isinstance(reply, Exception):
                log.debug("shared load update failed: %s", reply)
        self._carrying -= 1
        if self._carrying == 0:
            self._none_carried.set()

    async def _flush_loop(self) -> None:
        while True:
            await self._dirty.wait()
            async with self._writing:
                self._dirty.clear()
                unleased = sorted({model for model, _ in self._deltas} - self._leased)
                try:  # a model without a lease yet: its first snapshot carries these changes
                    for model in unleased:
                        await self._renew(model)
                except REDIS_FAILURES as exc:
                    log.debug("first lease failed: %s", exc)
                # a request booked and released within the window: no delta
                deltas, expects = self._take(leased_only=False)
                if not deltas and not expects:
                    continue
                self.flushes += 1
                try:  # lost deltas are healed by the next lease snapshot; expectations are a hint
                    async with asyncio.timeout(self._write_timeout_s):
                        await self.shared.write_many(deltas, expects)  # one round trip
                except REDIS_FAILURES as exc:
                    log.debug("shared load update failed: %s", exc)

    def idle(self) -> bool:
        """True when every change made so far has been written (or dropped after a failure)."""
        return (
            self._flush_due is None and not self._dirty.is_set() and not self._writing.locked() and self._carrying == 0
        )

    def inflight(self, model: str) -> dict[str, InflightLoad]:
        return dict(self._local.get(model, {}))

    async def renew_all(self, models: list[str]) -> None:
        for model in sorted(set(models) | set(self._local)):
            async with self._writing:
                await self._renew(model)

    async def _renew(self, model: str) -> None:
        """Renew ``model``'s lease with a snapshot of the local truth (the caller holds the lock).
        Until a replica's first lease for a model, Redis counts none of its load there."""
        # A batch still carrying changes (all in the snapshot) must land first: not after it.
        await self._none_carried.wait()
        # The snapshot already holds this model's unflushed changes: they are written by it, not
        # queued again (else Redis would count them twice until the next renewal).
        for key in [k for k in self._deltas if k[0] == model]:
            del self._deltas[key]
        await self.shared.renew(model, self._ttl_ms, self.inflight(model))
        self._leased.add(model)

    def start(self, models: Callable[[], list[str]]) -> ReplicaLoad:
        period = self._ttl_ms / 3000

        async def loop() -> None:
            renewed_at = -math.inf
            while True:
                # Every third of the lease, or at each look while alone on a model (see ALONE_RENEWAL_S).
                if time.monotonic() - renewed_at >= period or any(map(self.shared.alone, self._leased)):
                    renewed_at = time.monotonic()
                    try:
                        async with asyncio.timeout(max(period, self._write_timeout_s)):
                            await self.renew_all(models())
                    except REDIS_FAILURES as exc:
                        log.debug("lease renewal failed: %s", exc)
                await asyncio.sleep(min(period, self._alone_renewal_s))

        self._task = asyncio.create_task(loop())
        self._flusher = asyncio.create_task(self._flush_loop())
        return self

    async def stop(self, models: list[str]) -> None:
        if self._flush_due is not None:  # leaving takes this replica's load away in any case
            self._flush_due.cancel()
            self._flush_due = None
        for task in (self._task, self._flusher):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for model in sorted(set(models) | set(self._local)):
            with contextlib.suppress(*REDIS_FAILURES):
                await self.shared.leave(model)
