"""The routing port (kvindex.routing_index) in memory: the reference index and the replicas'
shared state in dicts, naive and obviously right, as :mod:`kvindex.reference` is for the index.

Several replicas share one :class:`MemoryStore` (as they share one Redis): each has its own
:class:`MemorySharedState` under its replica id. The rules are the Lua scripts' (lease.lua,
inflight.lua, inflight_add.lua, expect.lua, settle.lua, expected.lua): a replica's load counts
while its lease lives; a reader sums the replicas live at its own last lease; an expectation lasts
its TTL, and a settle only shortens one that still names the same worker.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kvindex.reference import ReferenceIndex
from kvindex.routing_index import IndexView, LoadCarrier, LoadDeltas
from kvindex.shared_load import Expectation, InflightLoad
from kvindex.types import WorkerRecord


@dataclass
class _ModelState:
    leases: dict[str, float] = field(default_factory=dict)  # replica id -> deadline (s)
    inflight: dict[str, dict[str, InflightLoad]] = field(default_factory=dict)  # replica -> worker -> load
    expected: dict[int, tuple[str, float]] = field(default_factory=dict)  # block -> (worker id, deadline)


class MemoryStore:
    """What the replicas share, as Redis would hold it; ``clock`` in seconds (tests move it)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._models: dict[str, _ModelState] = defaultdict(_ModelState)

    def model(self, model: str) -> _ModelState:
        return self._models[model]


class MemorySharedState:
    """One replica's part of a :class:`MemoryStore` (the port's :class:`SharedState`)."""

    def __init__(self, store: MemoryStore, replica_id: str) -> None:
        self.store = store
        self.replica_id = replica_id
        self._live: dict[str, list[str]] = {}  # model -> live replica ids, from the last lease

    def alone(self, model: str) -> bool:
        live = self._live.get(model)
        return live is not None and all(replica == self.replica_id for replica in live)

    async def renew(self, model: str, ttl_ms: int, snapshot: Mapping[str, InflightLoad]) -> int:
        state, now = self.store.model(model), self.store.clock()
        lapsed = [replica for replica, deadline in state.leases.items() if deadline <= now]
        for replica in lapsed:
            del state.leases[replica]
            state.inflight.pop(replica, None)
        state.leases[self.replica_id] = now + ttl_ms / 1000
        state.inflight[self.replica_id] = {w: load for w, load in snapshot.items() if load != InflightLoad()}
        self._live[model] = list(state.leases)
        return len(lapsed)

    async def write_many(self, deltas: LoadDeltas, expects: Sequence[Expectation]) -> None:
        for (model, worker_id), delta in deltas.items():
            mine = self.store.model(model).inflight.setdefault(self.replica_id, {})
            mine[worker_id] = mine.get(worker_id, InflightLoad()) + delta
        for model, worker_id, blocks, ttl_ms, settled in expects:
            state, now = self.store.model(model), self.store.clock()
            for block in blocks:
                if not settled:
                    state.expected[block] = (worker_id, now + ttl_ms / 1000)
                elif (entry := state.expected.get(block)) is not None and entry[0] == worker_id:
                    state.expected[block] = (worker_id, min(entry[1], now + ttl_ms / 1000))

    def others_totals(self, model: str, others_only: bool) -> dict[str, InflightLoad]:
        """inflight.lua over the replicas live at this replica's last lease (lapsed ones count nothing)."""
        state, now = self.store.model(model), self.store.clock()
        replicas = dict.fromkeys([self.replica_id, *self._live.get(model, ())])
        if others_only:
            replicas.pop(self.replica_id)
        totals: dict[str, InflightLoad] = defaultdict(InflightLoad)
        for replica in replicas:
            if state.leases.get(replica, 0.0) <= now:
                continue
            for worker_id, load in state.inflight.get(replica, {}).items():
                totals[worker_id] = totals[worker_id] + load
        return {w: load for w, load in totals.items() if load != InflightLoad()}

    def expected(self, model: str, blocks: Sequence[int]) -> list[str | None]:
        state, now = self.store.model(model), self.store.clock()
        entries = [state.expected.get(block) for block in blocks]
        return [entry[0] if entry is not None and entry[1] > now else None for entry in entries]

    async def totals(self, model: str) -> dict[str, InflightLoad]:
        state, now = self.store.model(model), self.store.clock()
        self._live[model] = [replica for replica, deadline in state.leases.items() if deadline > now]
        return self.others_totals(model, others_only=False)

    async def leave(self, model: str) -> None:
        state = self.store.model(model)
        state.leases.pop(self.replica_id, None)
        state.inflight.pop(self.replica_id, None)


class ReferenceRoutingIndex:
    """The routing port on :class:`ReferenceIndex` and a :class:`MemorySharedState`."""

    cancel_safe = True  # nothing is on a wire: a lookup abandoned mid-way costs nothing

    def __init__(self, index: ReferenceIndex, shared: MemorySharedState) -> None:
        self.index = index
        self.shared = shared

    async def lookup(
        self,
        model: str,
        chain: Sequence[int],
        checkpoints: Sequence[int] = (),
        carrier: LoadCarrier | None = None,
    ) -> IndexView:
        view = await self._read(model, chain, checkpoints)
        pending = carrier.carry() if carrier is not None else None
        if pending is not None and carrier is not None:
            await self.shared.write_many(*pending)  # as a batch carries them: after its reads
            carrier.carried([])
        return view

    async def _read(self, model: str, chain: Sequence[int], checkpoints: Sequence[int]) -> IndexView:
        matches = await self.index.match(model, chain)
        if self.shared.alone(model):
            return IndexView(matches, {}, {})
        expected_depth: dict[str, int] = defaultdict(int)
        holders = self.shared.expected(model, [chain[d - 1] for d in checkpoints])
        for depth, worker_id in zip(checkpoints, holders, strict=True):
            if worker_id is not None:
                expected_depth[worker_id] = max(expected_depth[worker_id], depth)
        return IndexView(matches, self.shared.others_totals(model, others_only=True), dict(expected_depth))

    async def group_holders(self, model: str, names: Sequence[int]) -> list[set[str]]:
        return await self.index.group_holders(model, names)

    async def workers(self, model: str) -> list[WorkerRecord]:
        return await self.index.workers(model)

    async def models(self) -> list[str]:
        return await self.index.models()
