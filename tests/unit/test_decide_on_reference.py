"""The router's decision on the reference routing port (kvindex.reference_routing): the index and
the replicas' shared state in memory, no Redis. The same Decider, Fleet and ReplicaLoad as a
running router, typed on the port; several replicas share one MemoryStore as they share Redis."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from kvindex.hashing import sequence_hashes
from kvindex.reference import ReferenceIndex
from kvindex.reference_routing import MemorySharedState, MemoryStore, ReferenceRoutingIndex
from kvindex.shared_load import InflightLoad
from kvindex.types import StoredRun, WorkerInfo
from router.routing.decide import Decider
from router.routing.decision import NoWorkers, hit_blocks, predicted_cached_tokens
from router.routing.fleet import Fleet
from router.routing.scoring import Policy, ScoringWeights
from router.shared.replica_load import ReplicaLoad

MODEL = "m"
PROMPT = list(range(1, 161))  # ten blocks of 16
LONG_TTL_MS = 600_000


@dataclass
class Replica:
    routing: ReferenceRoutingIndex
    load: ReplicaLoad
    decider: Decider


async def _replica(index: ReferenceIndex, store: MemoryStore, replica_id: str) -> Replica:
    routing = ReferenceRoutingIndex(index, MemorySharedState(store, replica_id))
    fleet = Fleet(routing)
    assert await fleet.try_refresh()
    load = ReplicaLoad(routing.shared, lease_ttl_ms=3_000, flush_window_s=0.0)
    decider = Decider(routing, load, fleet, ScoringWeights(), Policy.KV, redis_timeout_s=1.0)
    return Replica(routing, load, decider)


@pytest.fixture
async def fleet_of_two() -> AsyncIterator[tuple[ReferenceIndex, MemoryStore]]:
    index = ReferenceIndex()
    for name in ("a", "b"):
        await index.register(WorkerInfo(name, MODEL, f"http://{name}", 16), LONG_TTL_MS)
    yield index, MemoryStore()


async def test_the_decision_goes_to_the_worker_holding_the_longest_prefix(fleet_of_two):
    index, store = fleet_of_two
    await index.handle(MODEL, "b").store([StoredRun(None, tuple(sequence_hashes(PROMPT, 16)[:6]))])
    replica = await _replica(index, store, "r1")
    decision = await replica.decider.decide(MODEL, PROMPT)
    assert decision.choice.chosen.worker_id == "b" and not decision.degraded
    assert hit_blocks(decision, decision.choice.chosen) == 6
    assert predicted_cached_tokens(decision) == 96


async def test_a_replica_sees_the_load_another_booked(fleet_of_two):
    """Replica one books a long prefill on the worker that holds the prefix; replica two, which
    shares the store, sees that queue and weighs it (its lookup reads the others' totals)."""
    index, store = fleet_of_two
    await index.handle(MODEL, "a").store([StoredRun(None, tuple(sequence_hashes(PROMPT, 16)[:6]))])
    one, two = await _replica(index, store, "r1"), await _replica(index, store, "r2")
    for replica in (one, two):  # leases: each knows the other is live
        await replica.load.renew_all([MODEL])
    await one.load.renew_all([MODEL])
    assert not one.routing.shared.alone(MODEL)
    assert (await two.decider.decide(MODEL, PROMPT)).choice.chosen.worker_id == "a"  # the prefix, nothing booked
    one.load.book(MODEL, "a", InflightLoad(requests=1, prompt_tokens=50_000, uncached_tokens=50_000))
    await one.load.renew_all([MODEL])  # the lease snapshot writes it
    view = await two.routing.lookup(MODEL, sequence_hashes(PROMPT, 16))
    assert view.totals == {"a": InflightLoad(1, 50_000, 50_000)}
    assert (await two.decider.decide(MODEL, PROMPT)).choice.chosen.worker_id == "b"


async def test_a_lookup_carries_the_pending_changes_and_a_leaving_replica_stops_counting(fleet_of_two):
    index, store = fleet_of_two
    one, two = await _replica(index, store, "r1"), await _replica(index, store, "r2")
    for replica in (one, two, one):
        await replica.load.renew_all([MODEL])
    one.load.book(MODEL, "b", InflightLoad(requests=2, prompt_tokens=64, uncached_tokens=32), expected=[11, 12])
    assert not one.load.idle()
    await one.routing.lookup(MODEL, [1, 2], (1,), carrier=one.load)  # carries the booking: no flush
    assert one.load.idle() and one.load.flushes == 0
    assert await two.routing.shared.totals(MODEL) == {"b": InflightLoad(2, 64, 32)}
    assert (await two.routing.lookup(MODEL, [11, 12], (1, 2))).expected_depth == {"b": 2}
    await one.routing.shared.leave(MODEL)
    assert await two.routing.shared.totals(MODEL) == {}


async def test_an_unknown_model_has_no_workers(fleet_of_two):
    index, store = fleet_of_two
    replica = await _replica(index, store, "r1")
    with pytest.raises(NoWorkers):
        await replica.decider.decide("other", PROMPT)
