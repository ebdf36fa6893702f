"""One learned cost model for all router replicas, shared through Redis next to the index.

Each replica learns its model (:mod:`router.routing.ttft`) from the decisions and replies it sees: with
four replicas, a quarter of them. Every ``--model-sync-ms`` (1 s) it folds what it learned since
into the model's shared hash (``learn.lua``) and reads the whole model back in the same round
trip, so each replica routes by what all of them observed, as one replica seeing every request
would: its averages leave their priors as fast, its rates are fitted on four times the samples.
A new replica (a restart, a scale-out, another ``--workers`` process) starts from what the fleet
learned instead of the priors.

Every learned figure is an exponentially decayed sum, so a replica's new observations fold in as
``shared * factor + delta`` (:class:`router.routing.ttft.GroupChange`) whatever the other replicas added
meanwhile. A batch whose reply was lost is resent as it was, under the same id, and applied once.
Sharing is a help, never a dependency: while Redis does not answer, each replica keeps learning on
its own and sends what it learned once Redis is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvindex.errors import REDIS_FAILURES
from kvindex.replies import decode
from kvindex.shared_load import SharedLoad
from router.routing import tier_load, trade_check
from router.routing.ttft import SUM_FIELDS, GroupChange, GroupKey, TtftLearner

log = logging.getLogger("router.model_sync")  # the name it always had: log filters rely on it
FORGET_REPLICA_MS = 24 * 3600 * 1000  # a replica silent a day: its last batch id is dropped
MODEL_EXPIRY_MS = 7 * 24 * 3600 * 1000  # a model no replica added to for a week expires
STOP_SYNC_S = 0.5  # the last sync at shutdown waits this long at most
FORGET_WORKER_S = 600.0  # a worker gone this long loses its learned rate (a restart keeps it)


def field_names(key: GroupKey) -> list[str]:
    """The hash fields of one group: ``a:<average>``, ``S:<sum>`` / ``W:<sum>`` (the fleet's
    streamed / whole-reply sums), ``Q:<sum>`` (the queue's price, router.routing.trade_check),
    ``s:<sum>:<worker id>`` / ``w:<sum>:<worker id>``, ``t:<sum>:<tier>`` (a lower tier's load
    time, router.routing.tier_load)."""
    kind, name = key
    if kind == "a":
        return [f"a:{name}"]
    suffix = f":{name}" if name else ""
    return [f"{kind}:{sum_field}{suffix}" for sum_field in _fields_of(kind)]


def _fields_of(kind: str) -> tuple[str, ...]:
    if kind == "Q":
        return trade_check.FIELDS
    return tier_load.FIELDS if kind == "t" else SUM_FIELDS


def batch_args(changes: Sequence[GroupChange], deleted_fields: Sequence[str]) -> list[str]:
    """learn.lua's ARGV after its first four: the fields to delete, then the quadruples."""
    args = [str(len(deleted_fields)), *deleted_fields]
    for change in changes:
        for name, delta, base in zip(field_names(change.key), change.delta, change.base, strict=True):
            args += [name, repr(change.factor), repr(delta), repr(base)]
    return args


def parse_model(reply: Sequence[Any]) -> tuple[bool, dict[GroupKey, tuple[float, ...]]]:
    """learn.lua's reply -> (the batch was applied now, every complete group's values). Fields
    kvroute did not write, or not numbers, are skipped."""
    applied, *flat = reply
    values: dict[GroupKey, dict[str, float]] = defaultdict(dict)
    for i in range(0, len(flat) - 1, 2):
        kind, _, rest = decode(flat[i]).partition(":")
        try:
            value = float(decode(flat[i + 1]))
        except ValueError:
            continue
        if not math.isfinite(value):
            continue
        if kind == "a" and rest:
            values[("a", rest)]["value"] = value
        elif kind in ("S", "W", "Q") and rest:
            values[(kind, "")][rest] = value
        elif kind in ("s", "w", "t"):
            sum_field, _, worker = rest.partition(":")
            if worker:
                values[(kind, worker)][sum_field] = value
    groups: dict[GroupKey, tuple[float, ...]] = {}
    for key, fields in values.items():
        order = ("value",) if key[0] == "a" else _fields_of(key[0])
        if all(name in fields for name in order):
            groups[key] = tuple(fields[name] for name in order)
    return bool(int(applied)), groups


@dataclass(frozen=True)
class _Batch:
    batch_id: str
    changes: list[GroupChange]
    args: list[str]


@dataclass
class SyncStatus:
    """How sharing the model goes, for an operator (``GET /debug/model``'s ``shared``)."""

    enabled: bool
    syncs: int = 0
    failures: int = 0
    last_synced: dict[str, float] = field(default_factory=dict)  # model -> time.monotonic()

    def of(self, model: str) -> dict[str, Any]:
        synced = self.last_synced.get(model)
        ago = round((time.monotonic() - synced) * 1000, 1) if synced is not None else None
        return {"enabled": self.enabled, "last_sync_ms_ago": ago, "syncs": self.syncs, "failures": self.failures}


class ModelSync:
    """Shares this replica's learned models (one per model served) through Redis."""

    def __init__(
        self,
        shared: SharedLoad,
        learner_for: Callable[[str], TtftLearner],
        alive_workers: Callable[[str], list[str]],
        period_s: float,
        timeout_s: float = 2.0,
        forget_worker_s: float = FORGET_WORKER_S,
    ) -> None:
        self._shared = shared
        self._learner_for = learner_for
        self._alive_workers = alive_workers
        self._period_s = period_s
        self._timeout_s = max(timeout_s, period_s)
        self._forget_worker_s = forget_worker_s
        self._epoch = secrets.token_hex(6)  # batch ids of this process: a restart's never match
        self._batches = 0
        self._unanswered: dict[str, _Batch] = {}  # model -> a batch sent without a reply: resent as is
        self._gone_since: dict[str, dict[str, float]] = defaultdict(dict)  # model -> worker -> when
        self._task: asyncio.Task[None] | None = None
        self._bug_logged = False
        self.status = SyncStatus(enabled=period_s > 0)

    def learner(self, model: str) -> TtftLearner:
        """The learner this replica shares for ``model``."""
        return self._learner_for(model)

    async def sync(self, model: str) -> None:
        """Fold what was learned of ``model`` since the last sync into Redis; adopt the result."""
        learner = self._learner_for(model)
        batch = self._unanswered.get(model) or self._next_batch(model, learner)
        self._unanswered[model] = batch
        reply = await self._shared.learn(model, batch.batch_id, FORGET_REPLICA_MS, MODEL_EXPIRY_MS, batch.args)
        del self._unanswered[model]
        _, shared = parse_model(reply)
        learner.adopt(batch.changes, shared)
        self.status.syncs += 1
        self.status.last_synced[model] = time.monotonic()

    def _next_batch(self, model: str, learner: TtftLearner) -> _Batch:
        self._batches += 1
        deleted = [name for worker in self._gone_workers(model, learner) for name in _worker_fields(worker)]
        changes = learner.changes()
        return _Batch(f"{self._epoch}:{self._batches}", changes, batch_args(changes, deleted))

    def _gone_workers(self, model: str, learner: TtftLearner) -> list[str]:
        """Workers learned about that have not been alive for ``forget_worker_s``: forgotten
        here, and their fields deleted from the shared model."""
        now = time.monotonic()
        alive = set(self._alive_workers(model))
        gone_since = self._gone_since[model]
        for worker in learner.worker_ids():
            if worker in alive:
                gone_since.pop(worker, None)
            else:
                gone_since.setdefault(worker, now)
        forgotten = [w for w, since in gone_since.items() if now - since >= self._forget_worker_s]
        for worker in forgotten:
            del gone_since[worker]
            learner.forget(worker)
        return forgotten

    async def sync_all(self, models: Sequence[str]) -> None:
        for model in models:
            async with asyncio.timeout(self._timeout_s):
                await self.sync(model)

    async def try_sync_all(self, models: Sequence[str]) -> bool:
        """One sync of every model; False (logged) when Redis did not take it."""
        try:
            await self.sync_all(models)
            return True
        except REDIS_FAILURES as exc:
            self.status.failures += 1
            log.debug("sharing the learned cost model failed: %s", exc or type(exc).__name__)
            return False

    def start(self, models: Callable[[], list[str]]) -> ModelSync:
        if self.status.enabled:

            async def loop() -> None:
                while True:
                    await asyncio.sleep(self._period_s)
                    try:
                        await self.try_sync_all(models())
                    except Exception:  # a bug must not end the sharing for good: said once, retried
                        self.status.failures += 1
                        if not self._bug_logged:
                            log.exception("sharing the learned cost model failed")
                            self._bug_logged = True

            self._task = asyncio.create_task(loop())
        return self

    async def stop(self, models: list[str]) -> None:
        """Stop, sending what was learned since the last sync (best effort: a replica shutting
        down gives its last second of learning to the others)."""
        if self._task is None:
            return
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None
        with contextlib.suppress(TimeoutError):  # a Redis that is away must not hold the shutdown up
            async with asyncio.timeout(STOP_SYNC_S):
                await self.try_sync_all(models)


def _worker_fields(worker: str) -> list[str]:
    return field_names(("s", worker)) + field_names(("w", worker))
