"""The router's one port onto the index and the state router replicas share (issue 56, item 1).

A routing decision asks one question: for this prompt's block chain, which workers hold how much of
it, what load the other replicas have booked on each, and which workers recent decisions expect to
hold its checkpoints. :meth:`RoutingIndex.lookup` answers it in one :class:`IndexView`; how (one
pipelined round trip to a Redis server, a batch per shard of a cluster, a dict in memory) and what
rides along (the replica's pending load changes) is the backend's. The replica's own load is
booked, released, leased and left through :class:`SharedState`.

Two backends implement it: :class:`kvindex.redis_routing.RedisRoutingIndex` (the shared index in
Redis, single server or cluster, with its batching and cancellation inside) and
:class:`kvindex.reference_routing.ReferenceRoutingIndex` (the reference index and the shared state
in memory: the router's unit tests decide against it, and several replicas may share one store).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvindex.shared_load import Expectation, InflightLoad
from kvindex.types import WorkerRecord

LoadDeltas = Mapping[tuple[str, str], InflightLoad]  # (model, worker id) -> change


@dataclass(frozen=True)
class IndexView:
    """One lookup's answer, per worker id: matched blocks (a worker's lower cache tiers as their
    tier holders, kvindex/tiers.py), the load the other live replicas booked there, and the deepest
    of the asked checkpoints expected there."""

    matches: dict[str, int]
    totals: dict[str, InflightLoad]
    expected_depth: dict[str, int]


class LoadCarrier(Protocol):
    """A replica's pending shared-load writes, which a lookup may carry in its own round trip."""

    def carry(self) -> tuple[LoadDeltas, Sequence[Expectation]] | None:
        """The pending changes, no longer pending (the lookup writes them), or None: nothing to carry."""
        ...

    def carried(self, replies: Sequence[Any] | None) -> None:
        """The carried writes are done: their replies (exceptions for failed ones), None when lost."""
        ...


class SharedState(Protocol):
    """One replica's part of the state the replicas share: its in-flight load under a lease, and
    the prefixes its decisions expect on workers."""

    replica_id: str

    def alone(self, model: str) -> bool:
        """Whether this replica's last lease on ``model`` found no other live replica there."""
        ...

    async def renew(self, model: str, ttl_ms: int, snapshot: Mapping[str, InflightLoad]) -> int:
        """Renew the lease and replace this replica's load with ``snapshot``; the number of
        lapsed replicas forgotten."""
        ...

    async def write_many(self, deltas: LoadDeltas, expects: Sequence[Expectation]) -> None:
        """Load changes and expected prefixes, in one round trip."""
        ...

    async def totals(self, model: str) -> dict[str, InflightLoad]:
        """Every live replica's load, summed per worker (an observer's read)."""
        ...

    async def leave(self, model: str) -> None:
        """This replica's load stops counting at once (a graceful shutdown)."""
        ...


class RoutingIndex(Protocol):
    """What the router reads of the index and the shared state, and how it writes its own part."""

    @property
    def shared(self) -> SharedState:
        """This replica's part of the shared state."""
        ...

    @property
    def cancel_safe(self) -> bool:
        """Whether a lookup abandoned mid-flight costs nothing (its replies are read anyway): the
        router then runs it in the decision's own task and lets it carry pending writes."""
        ...

    async def lookup(
        self,
        model: str,
        chain: Sequence[int],
        checkpoints: Sequence[int] = (),
        carrier: LoadCarrier | None = None,
    ) -> IndexView:
        """The match of ``chain``; unless this replica is alone on ``model``, the other replicas'
        booked load and the workers expected to hold the blocks at ``checkpoints`` (depths, 1 for
        the first block). ``carrier``'s pending writes ride along where the backend can."""
        ...

    async def group_holders(self, model: str, names: Sequence[int]) -> list[set[str]]:
        """Per name, the alive workers that hold it (a hybrid model's window-group blocks)."""
        ...

    async def workers(self, model: str) -> list[WorkerRecord]: ...

    async def models(self) -> list[str]: ...
