"""The workers a router replica knows, per model, refreshed from the index every second.

Kept locally so that a decision never waits for a full worker listing, and so that when Redis is
down the router can still route (degraded mode) over the last workers it saw alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from redis.exceptions import RedisError

from kvindex.redis_index import RedisIndex
from kvindex.types import WorkerRecord

log = logging.getLogger(__name__)


class Fleet:
    def __init__(self, index: RedisIndex, refresh_s: float = 1.0) -> None:
        self._index = index
        self._refresh_s = refresh_s
        self._alive: dict[str, list[WorkerRecord]] = {}
        self._known_models: set[str] = set()
        self.refreshed_at = 0.0  # monotonic time of the last successful refresh; 0: never
        self.last_error: str | None = None  # why the last refresh failed; None after a success
        self._task: asyncio.Task[None] | None = None

    def start(self) -> Fleet:
        self._task = asyncio.create_task(self._loop())
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def refresh(self) -> None:
        models = await self._index.models()
        alive: dict[str, list[WorkerRecord]] = {}
        for model in models:
            alive[model] = [w for w in await self._index.workers(model) if w.alive]
        self._alive, self._known_models = alive, set(models)
        self.refreshed_at = time.monotonic()
        self.last_error = None

    async def try_refresh(self) -> bool:
        """Refresh within a bounded time; on failure keep the last known workers and say why."""
        try:
            async with asyncio.timeout(max(2.0, self._refresh_s)):
                await self.refresh()
            return True
        except (RedisError, OSError, TimeoutError) as exc:
            self.last_error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            log.debug("worker refresh failed (%s); keeping the last known workers", self.last_error)
            return False

    async def _loop(self) -> None:
        while True:
            await self.try_refresh()
            await asyncio.sleep(self._refresh_s)

    @property
    def has_view(self) -> bool:
        """True once a listing of the workers was read from Redis (it may be old now)."""
        return self.refreshed_at > 0

    @property
    def view_age_s(self) -> float | None:
        return time.monotonic() - self.refreshed_at if self.has_view else None

    def known(self, model: str) -> bool:
        return model in self._known_models

    def known_models(self) -> list[str]:
        return sorted(self._known_models)

    def alive(self, model: str) -> list[WorkerRecord]:
        return list(self._alive.get(model, ()))

    def models_with_workers(self) -> list[str]:
        return sorted(m for m, workers in self._alive.items() if workers)

    def drop(self, model: str, worker_id: str) -> None:
        """Stop offering a worker that just failed, until the next refresh says otherwise."""
        self._alive[model] = [w for w in self._alive.get(model, ()) if w.worker_id != worker_id]
