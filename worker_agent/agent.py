"""The agent's lifecycle: one per engine (per data-parallel rank).

Start (:mod:`worker_agent.main`): subscribe to the events first (so nothing published from then
on is lost), then here: wait for the engine's /health, learn the model and block size, register,
rebuild from the replay buffer, then run the loops below until stopped (SIGTERM), which
deregisters the worker (its entries stop counting at once).

* heartbeat: each second, on its own (:mod:`worker_agent.liveness`), from before the catch-up.
* events: receive, and apply in order (:mod:`worker_agent.pipeline`).
* liveness: re-assert everything when Redis lost the record, restarted (run_id changed), missed a
  write, or holds a different block count than the mirror, and periodically anyway.
* engine: /metrics every 250 ms -> the load signal in the index, the events watch
  (:class:`worker_agent.events.EventsWatch`) and the restart evidence
  (:mod:`worker_agent.restarts`: a new process -> the worker's entries are cleared).
* health: /health failing a few times in a row pauses heartbeats (the worker leaves routing when
  its TTL runs out) and keeps its entries; /health back resumes them.
* gc: a bounded step of the index's garbage collection now and then.

Every periodic step is guarded: an unexpected error is counted and logged, and the loop goes on.
Nothing but SIGTERM deregisters the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import zmq
import zmq.asyncio
from prometheus_client import Histogram

from kvindex.errors import REDIS_FAILURES
from kvindex.redis_index import RedisIndex
from kvindex.types import WorkerInfo
from worker_agent.engine import EngineClient, EngineMetrics
from worker_agent.engine_kinds import PAGED_DEFAULT_BLOCK_SIZE, chosen
from worker_agent.events import EventsWatch, stay_connected
from worker_agent.inbox import Inbox
from worker_agent.liveness import Liveness
from worker_agent.metrics import AgentCounters, Gauges
from worker_agent.pipeline import EventPipeline, Received
from worker_agent.poller import EventPoller
from worker_agent.replay import ReplayClient
from worker_agent.restarts import RestartEvidence
from worker_agent.settings import AgentSettings
from worker_agent.writer import WorkerWriter

log = logging.getLogger(__name__)
MAX_MESSAGES_PER_STEP = 512  # queued messages applied with one Lua call when the agent lags
EXIT_SUPERSEDED = 3
Step = Callable[[], Coroutine[Any, Any, None]]


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
        self.pipeline = EventPipeline(
            self.writer, replay, settings.topic, counters, latency, settings.block_size, settings.tiers
        )
        self.watch = EventsWatch(settings.events_source, settings.topic, settings.events_warn_after_s)
        self.liveness = Liveness(settings, index, self.writer, counters)
        self.restarts = RestartEvidence()
        self.inbox = Inbox(settings.max_queued_messages, settings.max_queued_bytes, counters)
        self.engine_up = False
        self.exit_code = 0
        self._subscriber = subscriber
        self._lock = asyncio.Lock()  # one writer at a time: op ids must reach Redis in order
        self._stop = stop or asyncio.Event()
        self._model = settings.model
        self._adapters: tuple[str, ...] = ()  # the LoRA adapters the engine serves, as last listed
        self._max_model_len = 0  # the engine's context length, from its listing (0: not said)
        self._listed_kind: str | None = None  # the engine kind its listing names
        self._health_failures = 0
        self._bad_metrics_said: set[str] = set()  # metrics whose bad values were logged (once each)
        self._last_error_log = 0.0

    # --- lifecycle ------------------------------------------------------------------------

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> int:
        """Start, run the loops until stopped (or one crashes: exit 1), then deregister."""
        # Heartbeats first and on their own: registration catches up from the replay buffer, which
        # may take up to --replay-deadline, and the worker must stay alive meanwhile.
        tasks = [asyncio.create_task(self._every(self.settings.heartbeat_interval_s, self._heartbeat_step))]
        tasks.append(asyncio.create_task(self.inbox.fill_from(self._subscriber, self.watch.message)))
        if self.settings.events is not None and not self.settings.polled:
            tasks.append(asyncio.create_task(stay_connected(self._subscriber, self.settings.events, self.counters)))
        try:
            if not await self._start():
                return self.exit_code
            if self.pipeline.kind.polled:  # its queue keeps the events until fetched: none is lost meanwhile
                poller = EventPoller(
                    self.engine.session,
                    self.settings.events_url,
                    self.counters,
                    max_bytes=self.settings.max_message_bytes,
                )
                tasks.append(asyncio.create_task(poller.fill(self.inbox, self.watch.message)))
            loops: list[tuple[float, Step]] = [
                (self.settings.heartbeat_interval_s, self._liveness_step),
                (self.settings.load_interval_s, self._engine_step),
                (self.settings.health_interval_s, self._health_step),
                (self.settings.health_interval_s, self._models_step),
                (self.settings.gc_interval_s, self._gc_step),
            ]
            tasks += [asyncio.create_task(self._every(seconds, step)) for seconds, step in loops]
            tasks.append(asyncio.create_task(self._events_loop()))
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
        self._take_engine_kind()
        metrics = await self.engine.metrics(self.pipeline.block_size)
        if metrics is not None:
            self._take_metrics(metrics)  # the restart evidence's first reading
        if self.pipeline.block_size is None:  # not in the settings: the engine's /metrics may say
            self.pipeline.block_size = metrics.block_size if metrics else None
        async with self._lock:
            await self._register_and_catch_up()
        return not self._stop.is_set()

    async def _learn_model(self) -> bool:
        """The model to index: --model, else the engine's one base model (its LoRA adapters are
        listed beside it and are not models of their own: their blocks are the base model's,
        hashed with the adapter's name)."""
        served = await self.engine.served_models()
        if served is not None:
            self._listed_kind = served.engine_kind
        if self._model is None and served is not None and len(served.bases) == 1:
            self._model = served.bases[0]
            self._adapters = served.adapters_of(self._model)
        if self._model is not None:
            if served is not None:  # its context length too, which routers check prompts against
                self._max_model_len = served.max_model_len.get(self._model, 0)
            return True
        if served is not None and served.bases:
            log.error("the engine serves %s: pass --model", list(served.bases))
        return False

    def _take_engine_kind(self) -> None:
        """Read the engine as --engine-kind says, else as its listing says, else as vLLM."""
        kind, how = chosen(self.settings.engine_kind, self._listed_kind)
        self.pipeline.set_engine_kind(kind, PAGED_DEFAULT_BLOCK_SIZE)
        self.engine.use_kind(kind)
        if kind.polled and not self.settings.polled:
            self.watch.endpoint = self.settings.events_url
            log.warning(
                "the engine is TensorRT-LLM, which hands out its KV events over HTTP: polling %s (--events %s is "
                "not used; pass --engine-kind trtllm to say so)",
                self.settings.events_url,
                self.settings.events,
            )
        block_size = self.pipeline.block_size or "from its events"
        fields = {"engine_kind": kind.name}
        log.info(
            "reading the engine as %s (%s); index block size %s", kind.name, how, block_size, extra={"fields": fields}
        )

    async def _register_and_catch_up(self) -> None:
        """Register (retrying while Redis is down) and rebuild from the replay buffer. Needs the
        block size; without one the first BlockStored brings it (see _events_loop)."""
        block_size = self.pipeline.block_size
        if block_size is None or self._model is None or self._stop.is_set():
            return
        settings = self.settings
        info = WorkerInfo(
            settings.resolved_worker_id,
            self._model,
            settings.engine_root,
            block_size,
            settings.dp_rank,
            self._adapters,
            role=settings.role,
            max_model_len=self._max_model_len,
            engine_kind=self.pipeline.kind.name,
        )
        while not await self.writer.register(info):
            if await self._sleep(settings.heartbeat_interval_s):
                return
        await self.liveness.registered()
        await self.pipeline.catch_up()

    async def _every(self, seconds: float, step: Step) -> None:
        """Run ``step`` every ``seconds`` until stopped, at a fixed rate (a slow step does not push
        the next one back; one that overran is not made up for with a burst)."""
        due = time.monotonic()
        while True:
            due = max(due + seconds, time.monotonic())
            if await self._sleep(due - time.monotonic()):
                return
            await self._guarded(step, step.__name__)

    async def _guarded(self, step: Step, what: str) -> None:
        """Run ``step``; an unexpected error is counted and logged (at most every 5 s), never
        raised: a bug in one step must not take a healthy worker out of the index."""
        try:
            await step()
        except Exception:
            self.counters.internal_errors += 1
            now = time.monotonic()
            if now - self._last_error_log > 5.0:
                self._last_error_log = now
                log.exception("unexpected error in the agent's %s; carrying on", what)

    async def _sleep(self, seconds: float) -> bool:
        """Sleep unless stopped first; True when stopped."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), seconds)
        return self._stop.is_set()

    # --- events ---------------------------------------------------------------------------

    async def _events_loop(self) -> None:
        while True:
            messages = await self.inbox.take(MAX_MESSAGES_PER_STEP)
            await self._guarded(functools.partial(self._apply, messages), "_apply")

    async def _apply(self, messages: list[Received]) -> None:
        async with self._lock:
            if not self.writer.registered:
                if not self.engine_up or not self.pipeline.learn_block_size(messages):
                    return  # the engine is down, or nothing here to index yet
                await self._register_and_catch_up()
            try:
                await self.pipeline.process(messages)
                if self.inbox.lost and not len(self.inbox):  # the dropped ones came after these
                    self.inbox.lost = False
                    await self.pipeline.repair_drops()
            except Exception:  # a bug must not stop the agent: rebuild from the replay buffer
                self.counters.internal_errors += 1
                log.exception("failed to apply engine batches; rebuilding this worker's entries")
                await self.pipeline.reset_worker()

    # --- liveness -------------------------------------------------------------------------

    async def _heartbeat_step(self) -> None:
        if self.engine_up:  # an engine that is down gets no heartbeats: routers stop using it
            await self.liveness.heartbeat()

    async def _liveness_step(self) -> None:
        if not self.engine_up:
            return  # a re-assert would make the worker alive again
        async with self._lock:
            await self.liveness.check()
        if self.liveness.superseded:
            worker = self.settings.resolved_worker_id
            log.error("another agent registered worker %s: stopping (exit %d)", worker, EXIT_SUPERSEDED)
            self.exit_code = EXIT_SUPERSEDED
            self._stop.set()

    async def _gc_step(self) -> None:
        if self.writer.registered:
            with contextlib.suppress(*REDIS_FAILURES):
                await self.index.gc(self.writer.model)

    # --- the engine -----------------------------------------------------------------------

    async def _engine_step(self) -> None:
        """The engine's /metrics: its load into the index, its work counters into the watch, and
        whether it is a new process."""
        metrics = await self.engine.metrics(self.pipeline.block_size)
        if metrics is None:
            return
        restarted = self._take_metrics(metrics)
        if restarted is not None:
            await self._engine_restarted(restarted)
        if self.engine_up:
            self.watch.engine_up(metrics.work, metrics.computed(self.pipeline.block_size))
            self.watch.check()
        if metrics.load is not None and self.writer.registered:
            await self.writer.report_load(metrics.load)

    def _take_metrics(self, metrics: EngineMetrics) -> str | None:
        """Count (and say once per metric) the values ignored; the evidence of a restart, if any."""
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
        return self.restarts.observe(metrics)

    async def _engine_restarted(self, why: str) -> None:
        """A new engine process: its cache is empty. Clear the worker and catch up from the new
        process's replay buffer (which has whatever it published before we noticed)."""
        async with self._lock:
            await self.pipeline.engine_restarted(why)
            if self.writer.registered:
                await self.pipeline.catch_up()

    async def _models_step(self) -> None:
        """The LoRA adapters the engine serves now (vLLM loads and unloads them at run time): a
        change goes into the worker's record, so routers send an adapter's requests only here."""
        if self._model is None or not self.engine_up:
            return
        served = await self.engine.served_models()
        if served is None:
            return
        self._adapters = served.adapters_of(self._model)  # what a registration announces
        info = self.writer.info
        if not self.writer.registered or info is None or info.adapters == self._adapters:
            return
        if await self.writer.set_adapters(self._adapters):
            log.info("the engine serves LoRA adapters %s", list(self._adapters) or "none")

    async def _health_step(self) -> None:
        if await self.engine.healthy():
            self._health_failures = 0
            if not self.engine_up:
                await self._engine_back()
            return
        self._health_failures += 1
        if self._health_failures == self.settings.health_failures and self.engine_up:
            self.engine_up = False
            self.counters.engine_down += 1
            self.watch.engine_down()
            log.warning(
                "engine /health failed %d times in a row: heartbeats pause (routers stop using the worker when "
                "its TTL runs out); its entries stay unless the engine comes back as a new process",
                self._health_failures,
            )

    async def _engine_back(self) -> None:
        """/health answers again: a restart only on evidence, then heartbeats resume."""
        metrics = await self.engine.metrics(self.pipeline.block_size)
        restarted = self._take_metrics(metrics) if metrics is not None else None
        if restarted is not None:
            await self._engine_restarted(restarted)
        self.engine_up = True
        log.info("engine /health answers again: heartbeats resume")
        if not self.writer.registered:
            async with self._lock:
                await self._register_and_catch_up()

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
            engine_start_time_seconds=self.restarts.start_time or 0.0,
            queued_messages=len(self.inbox),
            queued_bytes=self.inbox.bytes,
        )
