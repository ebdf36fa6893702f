"""The agent's lifecycle: one per engine (per data-parallel rank).

Start (:mod:`worker_agent.main`): subscribe to the events first (so nothing published from then
on is lost), then here: wait for the engine's /health, learn the model and block size, register,
rebuild from the replay buffer, then run the loops below until stopped (SIGTERM), which
deregisters the worker (its entries stop counting at once).

* events: receive, and apply in order (:mod:`worker_agent.pipeline`).
* liveness: heartbeat each second; re-assert everything when Redis lost the record, restarted
  (run_id changed), missed a write, or holds a different block count than the mirror, and
  periodically anyway.
* engine: /health (down for a few checks -> leave the index; back -> a new, empty cache) and
  /metrics every 250 ms -> the load signal in the index, and the events watch
  (:class:`worker_agent.events.EventsWatch`).
* gc: a bounded step of the index's garbage collection now and then.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Coroutine
from typing import Any

import zmq
import zmq.asyncio
from prometheus_client import Histogram

from kvindex.redis_index import RedisIndex
from kvindex.types import HeartbeatStatus, WorkerInfo
from worker_agent.engine import EngineClient, EngineMetrics
from worker_agent.events import EventsWatch
from worker_agent.metrics import AgentCounters, Gauges
from worker_agent.pipeline import EventPipeline, Received
from worker_agent.replay import ReplayClient
from worker_agent.settings import AgentSettings
from worker_agent.writer import REDIS_FAILURES, WorkerWriter

log = logging.getLogger(__name__)
MAX_MESSAGES_PER_STEP = 512  # queued messages applied with one Lua call when the agent lags
EXIT_SUPERSEDED = 3


class Agent:
    def __init__(
        self,
        settings: AgentSettings,
        index: RedisIndex,
        engine: EngineClient,
        subscriber: zmq.asyncio.Socket,
        replay: ReplayClient | None,
        counters: AgentCounters,
        latency: Histogram,
        stop: asyncio.Event | None = None,
    ) -> None:
        self.settings = settings
        self.index = index
        self.engine = engine
        self.counters = counters
        self.writer = WorkerWriter(index, counters, settings.ttl_ms)
        self.pipeline = EventPipeline(self.writer, replay, settings.topic, counters, latency, settings.block_size)
        self.watch = EventsWatch(settings.events, settings.topic, settings.events_warn_after_s)
        self.engine_up = False
        self.exit_code = 0
        self._subscriber = subscriber
        self._lock = asyncio.Lock()  # one writer at a time: op ids must reach Redis in order
        self._stop = stop or asyncio.Event()
        self._model = settings.model
        self._run_id: str | None = None
        self._run_id_missing_said = False
        self._heartbeat_status: HeartbeatStatus | None = None  # the heartbeat loop's last answer
        self._bad_metrics_said: set[str] = set()  # metrics whose bad values were logged (once each)
        self._last_loop_error_log = 0.0

    # --- lifecycle ------------------------------------------------------------------------

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> int:
        """Start, run the loops until stopped (or one crashes: exit 1), then deregister."""
        # Heartbeats first and on their own: registration catches up from the replay buffer, which
        # may take up to --replay-deadline, and the worker must stay alive meanwhile.
        tasks = [asyncio.create_task(self._heartbeat_loop())]
        try:
            if not await self._start():
                return self.exit_code
            loops: list[Callable[[], Coroutine[Any, Any, None]]] = [
                self._events_loop,
                self._liveness_loop,
                self._engine_loop,
                self._health_loop,
                self._gc_loop,
            ]
            tasks += [asyncio.create_task(loop()) for loop in loops]
            stop_task = asyncio.create_task(self._stop.wait())
            done, _ = await asyncio.wait([*tasks, stop_task], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not stop_task and task.exception() is not None:
                    log.error("agent loop crashed", exc_info=task.exception())
                    self.exit_code = 1
            stop_task.cancel()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self.exit_code != EXIT_SUPERSEDED:
                async with self._lock:
                    await self.writer.deregister()
        return self.exit_code

    async def _start(self) -> bool:
        """Wait for the engine, learn what is needed, register and catch up. False if stopped."""
        log.info("waiting for the engine at %s", self.engine.root)
        while not self._stop.is_set():
            if await self.engine.healthy() and await self._learn_model():
                break
            await self._sleep(self.settings.health_interval_s)
        if self._stop.is_set():
            return False
        self.engine_up = True
        if self.pipeline.block_size is None:  # not in the settings: the engine's /metrics may say
            metrics = await self.engine.metrics()
            self.pipeline.block_size = metrics.block_size if metrics else None
        async with self._lock:
            await self._register_and_catch_up()
        return not self._stop.is_set()

    async def _learn_model(self) -> bool:
        if self._model is not None:
            return True
        served = await self.engine.served_models()
        if len(served) == 1:
            self._model = served[0]
            return True
        if served:
            log.error("the engine serves %s: pass --model", served)
        return False

    async def _register_and_catch_up(self) -> None:
        """Register (retrying while Redis is down) and rebuild from the replay buffer. Needs the
        block size; without one the first BlockStored brings it (see _events_loop)."""
        block_size = self.pipeline.block_size
        if block_size is None or self._model is None or self._stop.is_set():
            return
        settings = self.settings
        info = WorkerInfo(settings.resolved_worker_id, self._model, settings.engine_root, block_size, settings.dp_rank)
        while not await self.writer.register(info):
            if await self._sleep(settings.heartbeat_interval_s):
                return
        with contextlib.suppress(*REDIS_FAILURES):
            self._run_id = await self._server_run_id()
        await self.pipeline.catch_up()

    async def _every(self, seconds: float, step: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run ``step`` every ``seconds`` until stopped. An unexpected error is counted and logged,
        and the loop goes on: a bug in one step must not take a healthy worker out of the index."""
        due = time.monotonic()
        while True:
            # A fixed rate (a slow step does not push the next one back), never a burst to catch up.
            due = max(due + seconds, time.monotonic())
            if await self._sleep(due - time.monotonic()):
                return
            try:
                await step()
            except Exception:
                self.counters.internal_errors += 1
                now = time.monotonic()
                if now - self._last_loop_error_log > 5.0:
                    self._last_loop_error_log = now
                    log.exception("unexpected error in the agent's %s; carrying on", step.__name__)

    async def _sleep(self, seconds: float) -> bool:
        """Sleep unless stopped first; True when stopped."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), seconds)
        return self._stop.is_set()

    # --- loops ----------------------------------------------------------------------------

    async def _receive(self) -> list[Received]:
        """The next message, and any queued behind it (up to MAX_MESSAGES_PER_STEP)."""
        messages = [Received(await self._subscriber.recv_multipart())]
        while len(messages) < MAX_MESSAGES_PER_STEP:
            try:
                messages.append(Received(await self._subscriber.recv_multipart(flags=zmq.NOBLOCK)))
            except zmq.Again:
                break
        self.watch.message()
        return messages

    async def _events_loop(self) -> None:
        while True:
            messages = await self._receive()
            async with self._lock:
                if not self.writer.registered:
                    if not self.engine_up or not self.pipeline.learn_block_size(messages):
                        continue  # the engine is down, or nothing here to index yet
                    await self._register_and_catch_up()
                try:
                    await self.pipeline.process(messages)
                except Exception:  # a bug must not stop the agent: rebuild from the replay buffer
                    self.counters.internal_errors += 1
                    log.exception("failed to apply engine batches; rebuilding this worker's entries")
                    await self.pipeline.reset_worker()

    async def _heartbeat_loop(self) -> None:
        await self._every(self.settings.heartbeat_interval_s, self._heartbeat_step)

    async def _heartbeat_step(self) -> None:
        """Keep the worker alive, without the writer lock: a replay or a long write never delays
        it. A status other than OK may be a race with this agent's own clear or re-assert (a new
        gid): the liveness step confirms it under the lock before acting."""
        if not self.writer.registered:
            return
        status = await self.writer.heartbeat()
        self._heartbeat_status = status
        self.counters.heartbeats += status is HeartbeatStatus.OK

    async def _liveness_loop(self) -> None:
        self._last_verify = time.monotonic()
        # A random phase, so that a fleet started together does not re-assert together.
        self._last_reassert = self._last_verify - random.uniform(0, self.settings.reassert_interval_s)
        await self._every(self.settings.heartbeat_interval_s, self._liveness_step)

    async def _liveness_step(self) -> None:
        async with self._lock:
            if not self.writer.registered:
                return
            reason = await self._reassert_reason()
            now = time.monotonic()
            if reason is None and now - self._last_verify >= self.settings.verify_interval_s:
                self._last_verify = now
                reason = "drift" if await self.writer.drifted() else None
            if reason is None and now - self._last_reassert >= self.settings.reassert_interval_s:
                reason = "periodic"
            if reason is not None and await self.writer.reassert(reason):
                self._last_reassert = now

    async def _reassert_reason(self) -> str | None:
        """Say why the index must be rewritten (None: it need not)."""
        status = self._heartbeat_status
        if status is not None and status is not HeartbeatStatus.OK:
            status = self._heartbeat_status = await self.writer.heartbeat()  # confirmed: no write in flight
        if status is HeartbeatStatus.SUPERSEDED:
            log.error("another agent registered worker %s: stopping (exit %d)", self.writer.worker_id, EXIT_SUPERSEDED)
            self.exit_code = EXIT_SUPERSEDED
            self.writer.superseded()
            self._stop.set()
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
        try:
            return await self.index.server_run_id()
        except KeyError:
            if not self._run_id_missing_said:
                self._run_id_missing_said = True
                log.warning(
                    "Redis's INFO has no run_id: a Redis restart is noticed when this worker's record is "
                    "missing or its block count is off, not by run_id"
                )
            return None

    async def _engine_loop(self) -> None:
        await self._every(self.settings.load_interval_s, self._engine_step)

    async def _engine_step(self) -> None:
        """The engine's /metrics: its load into the index, its work counters into the watch."""
        metrics = await self.engine.metrics()
        if metrics is None:
            return
        self._note_bad_metrics(metrics)
        if self.engine_up:
            self.watch.engine_up(metrics.work)
            self.watch.check()
        if metrics.load is not None and self.writer.registered:
            await self.writer.report_load(metrics.load)

    def _note_bad_metrics(self, metrics: EngineMetrics) -> None:
        """Count each ignored value; say why once per metric (the page is read 4 times a second)."""
        for bad in metrics.bad:
            self.counters.engine_metric_errors += 1
            if bad.metric not in self._bad_metrics_said:
                self._bad_metrics_said.add(bad.metric)
                log.warning(
                    "ignoring the engine's %s: %s (counted in kvroute_agent_engine_metric_errors_total; "
                    "said once per metric)",
                    bad.metric,
                    bad.reason,
                    extra={"fields": {"metric": bad.metric, "reason": bad.reason}},
                )

    async def _health_loop(self) -> None:
        failures = 0
        while not await self._sleep(self.settings.health_interval_s):
            if await self.engine.healthy():
                failures = 0
                if not self.engine_up:
                    self.engine_up = True
                    async with self._lock:
                        await self.pipeline.engine_restarted("/health is back")
                        await self._register_and_catch_up()
                continue
            failures += 1
            if failures == self.settings.health_failures and self.engine_up:
                self.engine_up = False
                self.counters.engine_down += 1
                self.watch.engine_down()
                log.warning("engine /health failed %d times: leaving the index until it is back", failures)
                async with self._lock:
                    await self.writer.deregister()
                    self.pipeline.reset()

    async def _gc_loop(self) -> None:
        await self._every(self.settings.gc_interval_s, self._gc_step)

    async def _gc_step(self) -> None:
        if self.writer.registered:
            with contextlib.suppress(*REDIS_FAILURES):
                await self.index.gc(self.writer.model)

    # --- views ----------------------------------------------------------------------------

    def gauges(self) -> Gauges:
        mirror = self.writer.mirror
        return Gauges(
            mirror_blocks=len(mirror) if mirror is not None else 0,
            mirror_indexed_blocks=mirror.indexed_count if mirror is not None else 0,
            engine_hashes=self.pipeline.engine_hashes,
            registered=self.writer.registered,
            engine_up=self.engine_up,
            last_seq=self.pipeline.last_seq,
            events_silent=self.watch.silent,
            last_event_timestamp_seconds=self.watch.last_message_time or 0.0,
        )
