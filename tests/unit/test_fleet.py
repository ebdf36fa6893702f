"""router.routing.fleet: which workers a replica offers when Redis's listing loses them."""

from __future__ import annotations

from kvindex.reference import ReferenceIndex
from kvindex.reference_routing import MemorySharedState, MemoryStore, ReferenceRoutingIndex
from kvindex.types import WorkerRecord
from router.routing.fleet import Fleet


def _reference() -> ReferenceRoutingIndex:
    """An empty index: these tests hand the fleet its listings themselves."""
    return ReferenceRoutingIndex(ReferenceIndex(), MemorySharedState(MemoryStore(), "r"))


def _worker(name: str, model: str = "m") -> WorkerRecord:
    return WorkerRecord(
        worker_id=name,
        model=model,
        url=f"http://{name}",
        block_size=16,
        dp_rank=0,
        gid=1,
        epoch=1,
        alive=True,
        blocks=0,
        heartbeat_age_ms=0,
        ttl_ms=5000,
    )


def _ids(fleet: Fleet, model: str = "m") -> list[str]:
    return [w.worker_id for w in fleet.alive(model)]


def test_an_empty_listing_keeps_the_last_known_workers_for_the_retain_time():
    fleet = Fleet(index=_reference(), retain_s=30)
    fleet.apply_listing({"m": [_worker("a"), _worker("b")]}, now=100)
    fleet.apply_listing({}, now=101)  # FLUSHALL: no model, no worker
    assert _ids(fleet) == ["a", "b"] and fleet.known("m") and fleet.retained_models() == ["m"]
    fleet.apply_listing({"m": []}, now=129)  # the model is back, its workers not yet
    assert _ids(fleet) == ["a", "b"]
    fleet.apply_listing({"m": []}, now=131.5)  # 30 s after Redis first listed none
    assert _ids(fleet) == [] and fleet.retained_models() == [] and fleet.known("m")
    fleet.apply_listing({}, now=132)
    assert not fleet.known("m")


def test_redis_listing_workers_again_ends_the_retention_and_wins():
    fleet = Fleet(index=_reference(), retain_s=30)
    fleet.apply_listing({"m": [_worker("a"), _worker("b")]}, now=0)
    fleet.apply_listing({}, now=1)
    fleet.apply_listing({"m": [_worker("b")]}, now=2)  # one agent re-registered: Redis's view wins
    assert _ids(fleet) == ["b"] and fleet.retained_models() == []
    fleet.apply_listing({}, now=50)  # lost again later: a new retention, from now
    assert _ids(fleet) == ["b"] and fleet.retained_models() == ["m"]


def test_a_retained_worker_the_proxy_dropped_is_not_offered_again():
    fleet = Fleet(index=_reference(), retain_s=30)
    fleet.apply_listing({"m": [_worker("a"), _worker("b")]}, now=0)
    fleet.apply_listing({}, now=1)
    fleet.drop("m", "a")
    fleet.apply_listing({}, now=2)
    assert _ids(fleet) == ["b"]
    fleet.drop("m", "b")
    fleet.apply_listing({}, now=3)  # none left, but the model is still known (503, not 404)
    assert _ids(fleet) == [] and fleet.known("m") and fleet.models_with_workers() == []


def test_other_models_are_not_affected_and_retain_zero_forgets_at_once():
    fleet = Fleet(index=_reference(), retain_s=0)
    fleet.apply_listing({"m": [_worker("a")], "n": [_worker("x", "n")]}, now=0)
    fleet.apply_listing({"n": [_worker("x", "n")]}, now=1)
    assert _ids(fleet) == [] and _ids(fleet, "n") == ["x"] and not fleet.known("m")


def test_workers_that_deregistered_are_not_retained_and_their_model_is_forgotten():
    """The last worker's agent stopped cleanly: its record is gone while Redis still lists the
    model, so it left (no retention, no request sent to it) and the model is unknown (404). A
    worker whose record stays but whose heartbeat is late may be a failover's lost writes: kept."""
    fleet = Fleet(index=_reference(), retain_s=30)
    fleet.apply_listing({"m": [_worker("a"), _worker("b")]}, now=0, recorded={"m": {"a", "b"}})
    fleet.apply_listing({"m": [_worker("b")]}, now=1, recorded={"m": {"b"}})  # a left
    assert _ids(fleet) == ["b"]
    fleet.apply_listing({"m": []}, now=2, recorded={"m": set()})  # b left too
    assert _ids(fleet) == [] and fleet.retained_models() == [] and not fleet.known("m")
    fleet.apply_listing({"m": [_worker("c")]}, now=3, recorded={"m": {"c"}})
    fleet.apply_listing({"m": []}, now=4, recorded={"m": {"c"}})  # c's heartbeat late, its record there
    assert _ids(fleet) == ["c"] and fleet.retained_models() == ["m"] and fleet.known("m")
    fleet.apply_listing({"m": []}, now=5, recorded={"m": set()})  # then gc retired it: it is gone
    assert _ids(fleet) == [] and not fleet.known("m")
