"""This replica's in-flight requests per worker: the local truth behind its shared load.

Every booking is also sent to Redis at once (HINCRBY, via :class:`~kvindex.shared_load.SharedLoad`);
every second the lease is renewed with a full snapshot of this truth, which heals any update that
was lost while Redis was unreachable. On shutdown the replica leaves, and its load with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import Callable

from redis.exceptions import RedisError

from kvindex.errors import KVIndexError
from kvindex.shared_load import InflightLoad, SharedLoad

log = logging.getLogger(__name__)
FAILURES = (RedisError, OSError, TimeoutError, KVIndexError)


class ReplicaLoad:
    def __init__(self, shared: SharedLoad, lease_ttl_ms: int) -> None:
        self.shared = shared
        self._ttl_ms = lease_ttl_ms
        self._local: dict[str, dict[str, InflightLoad]] = defaultdict(lambda: defaultdict(InflightLoad))
        self._task: asyncio.Task[None] | None = None

    def book(self, model: str, worker_id: str, load: InflightLoad) -> None:
        self._local[model][worker_id] = self._local[model][worker_id] + load

    async def release(self, model: str, worker_id: str, load: InflightLoad) -> None:
        self._local[model][worker_id] = self._local[model][worker_id] + (-load)
        if self._local[model][worker_id] == InflightLoad():
            del self._local[model][worker_id]
        with contextlib.suppress(*FAILURES):
            await asyncio.wait_for(self.shared.add(model, worker_id, -load), 0.5)

    def inflight(self, model: str) -> dict[str, InflightLoad]:
        return dict(self._local.get(model, {}))

    async def renew_all(self, models: list[str]) -> None:
        for model in sorted(set(models) | set(self._local)):
            await self.shared.renew(model, self._ttl_ms, self.inflight(model))

    def start(self, models: Callable[[], list[str]]) -> ReplicaLoad:
        async def loop() -> None:
            while True:
                try:
                    await self.renew_all(models())
                except FAILURES as exc:
                    log.debug("lease renewal failed: %s", exc)
                await asyncio.sleep(self._ttl_ms / 3000)

        self._task = asyncio.create_task(loop())
        return self

    async def stop(self, models: list[str]) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for model in sorted(set(models) | set(self._local)):
            with contextlib.suppress(*FAILURES):
                await self.shared.leave(model)
