"""The worker's liveness in the index: heartbeats, and when to rewrite everything (re-assert).

Heartbeats (:meth:`Liveness.heartbeat`) run on their own schedule without the agent's writer lock,
so that no replay, long write or re-assert delays them. Because they run beside the writes, a
status other than OK may only mean that this agent's own clear or re-assert gave the worker a new
gid while the heartbeat was in flight; :meth:`Liveness.check`, called under the lock (no write in
flight), asks again before acting on it.

:meth:`Liveness.check` re-asserts (a fresh generation, the whole mirror written back) when the
worker's record is missing (Redis lost data), Redis's ``run_id`` changed (a restart, failover or
flush that kept the record), a write failed, the block count in Redis differs from the mirror
(every ``verify_interval_s``), and every ``reassert_interval_s`` anyway.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time

from kvindex.errors import REDIS_FAILURES
from kvindex.redis_index import RedisIndex
from kvindex.types import HeartbeatStatus
from worker_agent.metrics import AgentCounters
from worker_agent.settings import AgentSettings
from worker_agent.writer import WorkerWriter

log = logging.getLogger(__name__)


class Liveness:
    def __init__(
        self, settings: AgentSettings, index: RedisIndex, writer: WorkerWriter, counters: AgentCounters
    ) -> None:
        self.settings = settings
        self.index = index
        self.writer = writer
        self.counters = counters
        self.superseded = False  # another agent registered this worker id: stop, without deregistering
        self._status: HeartbeatStatus | None = None  # the last heartbeat's answer
        self._run_id: str | None = None
        self._run_id_missing_said = False
        self._last_verify = time.monotonic()
        # A random phase, so that a fleet started together does not re-assert together.
        self._last_reassert = self._last_verify - random.uniform(0, settings.reassert_interval_s)

    async def heartbeat(self) -> None:
        """One heartbeat (lock-free; see the module's docstring)."""
        if not self.writer.registered:
            return
        self._status = await self.writer.heartbeat()
        self.counters.heartbeats += self._status is HeartbeatStatus.OK

    async def registered(self) -> None:
        """The worker was just registered: remember the Redis run_id it was registered on."""
        with contextlib.suppress(*REDIS_FAILURES):
            self._run_id = await self._server_run_id()

    async def check(self) -> None:
        """Re-assert when needed (the caller holds the writer lock)."""
        if not self.writer.registered:
            return
        reason = await self._reassert_reason()
        now = time.monotonic()
        if reason is None and not self.superseded and now - self._last_verify >= self.settings.verify_interval_s:
            self._last_verify = now
            reason = "drift" if await self.writer.drifted() else None
        if reason is None and not self.superseded and now - self._last_reassert >= self.settings.reassert_interval_s:
            reason = "periodic"
        if reason is not None and await self.writer.reassert(reason):
            self._last_reassert = now

    async def _reassert_reason(self) -> str | None:
        """Why the index must be rewritten (None: it need not, or the worker was superseded)."""
        status = self._status
        if status is not None and status is not HeartbeatStatus.OK:
            status = self._status = await self.writer.heartbeat()  # asked again with no write in flight
        if status is HeartbeatStatus.SUPERSEDED:
            self.superseded = True
            self.writer.superseded()
            return None
        if status is HeartbeatStatus.MISSING:
            return "missing"
        try:
            run_id = await self._server_run_id()
        except REDIS_FAILURES:
            return None
        restarted = None not in (run_id, self._run_id) and run_id != self._run_id
        self._run_id = run_id or self._run_id
        if restarted:
            return "redis_restart"
        return "write_failed" if self.writer.needs_reassert() else None

    async def _server_run_id(self) -> str | None:
        """Redis's run_id; None when its INFO has none (some proxies and managed services): then a
        restart shows only as the worker's record missing, or as the block-count check failing."""
        run_id = await self.index.server_run_id()
        if run_id is None and not self._run_id_missing_said:
            self._run_id_missing_said = True
            log.warning(
                "Redis's INFO has no run_id: a Redis restart is noticed when this worker's record is "
                "missing or its block count is off, not by run_id"
            )
        return run_id
