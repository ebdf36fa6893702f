"""The workers a router replica knows, per model, refreshed from the index every second.

Kept locally so that a decision never waits for a full worker listing, and so that Redis never
makes a request fail: while Redis is unreachable the router routes (degraded) over the last
workers it saw alive; and when Redis answers but lists no alive worker for a model it served a
moment ago (a FLUSHALL, a restart that lost its data, a failover that lost the last writes), the
last known workers are *retained* for ``retain_s`` seconds, long enough for the agents to
re-register, instead of answering 404 for a model that was served a second ago. A worker the
proxy cannot connect to is dropped by the failover (:meth:`Fleet.drop`) whatever the view. A
worker whose URL is outside ``--worker-allow`` (:mod:`router.routing.allow`) is never offered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

from kvindex.errors import REDIS_FAILURES
from kvindex.groups import GroupSpec, is_hybrid, parse_groups
from kvindex.roles import PREFILL
from kvindex.routing_index import RoutingIndex
from kvindex.tiers import GPU
from kvindex.types import WorkerRecord
from router.routing.allow import WorkerAllowList

log = logging.getLogger("router.fleet")  # the name it always had: log filters rely on it
DEFAULT_RETAIN_S = 30.0


@dataclass(frozen=True)
class Served:
    """What a request's ``model`` names: a base model, or a LoRA adapter of one (vLLM serves an
    adapter under its own name). The base model keys the index, its block size and tokenizer; the
    adapter's name goes into the prompt's block hashes (vLLM's extra keys), and only workers whose
    engine serves the adapter are offered."""

    model: str
    adapter: str | None = None


class Fleet:
    def __init__(
        self,
        index: RoutingIndex,
        refresh_s: float = 1.0,
        retain_s: float = DEFAULT_RETAIN_S,
        allow: WorkerAllowList | None = None,
    ) -> None:
        self._index = index
        self._allow = allow or WorkerAllowList()
        self._refresh_s = refresh_s
        self._retain_s = retain_s
        self._alive: dict[str, list[WorkerRecord]] = {}
        # (model, worker id) -> {tier: blocks} its lower tiers' holders list (kvindex/tiers.py)
        self._tier_blocks: dict[tuple[str, str], dict[str, int]] = {}
        self._tiered_models: set[str] = set()
        self._groups: dict[str, tuple[GroupSpec, ...]] = {}  # hybrid models' KV-cache groups
        self._roles: dict[str, dict[str, str]] = {}  # model -> worker id -> role, as last listed
        self._split_models: set[str] = set()  # models with a prefill worker
        self._context_lengths: dict[str, int] = {}  # model -> the shortest max_model_len registered
        self._known_models: set[str] = set()
        # model -> monotonic time since when Redis has listed no alive worker for a model whose
        # last known workers are still offered (retained).
        self._missing_since: dict[str, float] = {}
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
        listed: dict[str, list[WorkerRecord]] = {}
        recorded: dict[str, set[str]] = {}
        tier_blocks: dict[tuple[str, str], dict[str, int]] = {}
        for model in models:
            workers = await self._index.workers(model)
            recorded[model] = {w.worker_id for w in workers if w.tier == GPU}
            for holder in workers:
                if holder.alive and holder.tier != GPU and holder.tier_of is not None:
                    tier_blocks.setdefault((model, holder.tier_of), {})[holder.tier] = holder.blocks
            # a worker's lower cache tiers are registrations of their own (kvindex/tiers.py), not workers
            listed[model] = [w for w in workers if w.alive and w.tier == GPU and self._allow.admits(w.worker_id, w.url)]
        self.apply_listing(listed, time.monotonic(), recorded)
        self._groups = {model: groups for model, workers in listed.items() if (groups := _hybrid_groups(workers))}
        self._tier_blocks = tier_blocks
        self._tiered_models = {model for model, _ in tier_blocks}
        self.last_error = None

    def apply_listing(
        self, listed: dict[str, list[WorkerRecord]], now: float, recorded: Mapping[str, set[str]] | None = None
    ) -> None:
        """Take Redis's listing, retaining the last known workers of a model it lists none for.
        ``recorded``: per listed model, the workers that have a record, alive or not. A worker
        whose record is gone from a model Redis still lists deregistered (its agent stopped, or
        gc retired it): it left, and is not retained; a whole model gone is lost data, and is."""
        alive = {model: workers for model, workers in listed.items() if workers}
        for model in set(self._alive) | set(self._missing_since):
            if model in alive:
                self._missing_since.pop(model, None)  # back in Redis
                continue
            workers = self._alive.get(model, [])
            if recorded is not None and model in recorded:
                workers = [w for w in workers if w.worker_id in recorded[model]]
                if not workers:  # every one of them left: nothing to wait for
                    self._missing_since.pop(model, None)
                    continue
            if model not in self._missing_since:
                if not workers:
                    continue  # none before either: nothing to retain
                self._missing_since[model] = now
                log.warning(
                    "Redis lists no alive worker of model %r (lost data?); keeping its %d last known "
                    "workers for up to %.0f s, until the agents re-register",
                    model,
                    len(workers),
                    self._retain_s,
                )
            if now - self._missing_since[model] < self._retain_s:
                alive[model] = workers  # possibly none left: all found dead by the proxy
            else:
                del self._missing_since[model]
                log.warning("model %r: no worker re-registered within %.0f s; forgetting it", model, self._retain_s)
        self._alive = alive
        # read by every decision: kept with the listing, not rebuilt per request
        self._roles = {model: {w.worker_id: w.role for w in workers} for model, workers in alive.items()}
        self._split_models = {model for model, roles in self._roles.items() if PREFILL in roles.values()}
        self._context_lengths = {
            model: min(lengths)
            for model, workers in alive.items()
            if (lengths := [w.max_model_len for w in workers if w.max_model_len])
        }
        # a model is known while some worker of it has a record (503 while none is alive), else 404
        with_records = set(listed) if recorded is None else {m for m in listed if recorded.get(m)}
        self._known_models = with_records | set(self._missing_since)
        self.refreshed_at = now

    async def try_refresh(self) -> bool:
        """Refresh within a bounded time; on failure keep the last known workers and say why."""
        try:
            async with asyncio.timeout(max(2.0, self._refresh_s)):
                await self.refresh()
            return True
        except REDIS_FAILURES as exc:
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

    def retained_models(self) -> list[str]:
        """Models served from their last known workers because Redis lists none alive now."""
        return sorted(self._missing_since)

    def known(self, model: str) -> bool:
        return model in self._known_models

    def known_models(self) -> list[str]:
        return sorted(self._known_models)

    def alive(self, model: str, adapter: str | None = None) -> list[WorkerRecord]:
        """The alive workers of ``model`` (that serve ``adapter``, when one is named)."""
        workers = self._alive.get(model, ())
        return [w for w in workers if adapter in w.adapters] if adapter is not None else list(workers)

    def served(self, name: str) -> Served | None:
        """``name`` as a base model with alive workers, else as an adapter an alive worker serves
        (None: neither). A base model's name wins over an adapter's of the same name."""
        if self._alive.get(name):
            return Served(name)
        for model, workers in sorted(self._alive.items()):
            if any(name in w.adapters for w in workers):
                return Served(model, name)
        return None

    def tiered(self, model: str) -> bool:
        """Whether a worker of ``model`` has a lower cache tier (a tier holder), as last listed: a
        decision reads the tiers' depths only then."""
        return model in self._tiered_models

    def tier_blocks(self, model: str, worker_id: str) -> dict[str, int]:
        """The blocks each lower tier of a worker holds, as the last listing said ({} for none)."""
        return dict(self._tier_blocks.get((model, worker_id), {}))

    def kv_groups(self, model: str) -> tuple[GroupSpec, ...]:
        """A hybrid model's KV-cache groups, as its workers' records say (() for other models)."""
        return self._groups.get(model, ())

    def roles(self, model: str) -> Mapping[str, str]:
        """Each worker's role in a prefill/decode split (kvindex/roles.py), as last listed."""
        return self._roles.get(model, {})

    def disaggregated(self, model: str) -> bool:
        """Whether a worker of ``model`` was listed as a prefill worker: its requests may be split."""
        return model in self._split_models

    def context_length(self, model: str) -> int | None:
        """The shortest max_model_len its workers registered, as last listed (None: none said): a
        longer request fails on every engine that has the smaller one."""
        return self._context_lengths.get(model)

    def adapters(self, model: str) -> list[str]:
        """The adapters of ``model`` that an alive worker serves."""
        return sorted({a for w in self._alive.get(model, ()) for a in w.adapters})

    def models_with_workers(self) -> list[str]:
        return sorted(m for m, workers in self._alive.items() if workers)

    def drop(self, model: str, worker_id: str) -> None:
        """Stop offering a worker that just failed, until a refresh lists it alive again (a
        retained worker is not offered again: Redis does not list it)."""
        self._alive[model] = [w for w in self._alive.get(model, ()) if w.worker_id != worker_id]


def _hybrid_groups(workers: list[WorkerRecord]) -> tuple[GroupSpec, ...]:
    """The KV-cache groups the workers' records name, when the model is hybrid (a record the
    router cannot read is logged and passed over)."""
    for worker in workers:
        if worker.kv_groups:
            try:
                groups = parse_groups(worker.kv_groups)
            except ValueError as exc:
                log.warning("worker %s: %s", worker.worker_id, exc)
                continue
            return groups if is_hybrid(groups) else ()
    return ()
