"""Shared routing state across router replicas (Redis only: it lives beside the index)."""

from __future__ import annotations

import asyncio
import time

from kvindex.hashing import sequence_hashes
from kvindex.keys import KeySchema
from kvindex.shared_load import Expectation, InflightLoad, SharedLoad
from tests.support import wait_until


async def _another_replica(redis_client, model: str) -> None:
    """A second replica live on ``model``: the first one's changes are read by someone."""
    await SharedLoad(redis_client, KeySchema(), "another-replica").renew(model, 60_000, {})


async def test_replicas_see_each_others_load_and_a_dead_replica_stops_counting(redis_client, unique_name):
    a = SharedLoad(redis_client, KeySchema(), "replica-a")
    b = SharedLoad(redis_client, KeySchema(), "replica-b")
    await a.renew(unique_name, 60_000, {})
    b_renewed_at = time.monotonic()
    await b.renew(unique_name, 300, {})
    await a.renew(unique_name, 60_000, {})  # a learns of b at its next renewal
    await a.add(unique_name, "w1", InflightLoad(1, 100, 40))
    await b.add(unique_name, "w1", InflightLoad(2, 50, 10))
    await b.add(unique_name, "w2", InflightLoad(1, 7, 7))
    totals = await a.totals(unique_name)
    assert totals == {"w1": InflightLoad(3, 150, 50), "w2": InflightLoad(1, 7, 7)}
    await a.add(unique_name, "w1", -InflightLoad(1, 100, 40))
    assert (await b.totals(unique_name))["w1"] == InflightLoad(2, 50, 10)

    async def b_expired() -> bool:  # b's lease runs out: as if it was killed
        return await a.totals(unique_name) == {}

    await wait_until(b_expired, 5, interval=0.02)
    assert time.monotonic() - b_renewed_at > 0.25  # only once the 300 ms lease has run out
    assert await a.renew(unique_name, 60_000, {}) == 1  # forgotten; its hash expires by itself
    assert await redis_client.pttl(KeySchema().for_model(unique_name).inflight("replica-b")) > 0


async def test_a_renewal_replaces_drifted_counts_with_the_local_truth(redis_client, unique_name):
    load = SharedLoad(redis_client, KeySchema(), "r")
    await load.renew(unique_name, 60_000, {})
    await load.add(unique_name, "w", InflightLoad(5, 500, 5))  # say the decrements were lost
    await load.renew(unique_name, 60_000, {"w": InflightLoad(1, 10, 0)})
    assert await load.totals(unique_name) == {"w": InflightLoad(1, 10, 0)}
    await load.leave(unique_name)
    assert await load.totals(unique_name) == {}


async def test_expected_prefixes_lapse(redis_client, unique_name):
    load = SharedLoad(redis_client, KeySchema(), "r")
    chain = sequence_hashes(list(range(64)), 16)
    expected_at = time.monotonic()
    await load.expect(unique_name, "w7", chain[:2], ttl_ms=300)
    assert await load.expected(unique_name, chain) == ["w7", "w7", None, None]

    async def lapsed() -> bool:
        return await load.expected(unique_name, chain) == [None] * 4

    await wait_until(lapsed, 5, interval=0.02)
    assert time.monotonic() - expected_at > 0.25  # after the 300 ms TTL, not before
    await load.expect(unique_name, "w8", chain[3:], ttl_ms=60_000)  # also sweeps the lapsed ones
    keys = KeySchema().for_model(unique_name)
    assert await redis_client.hlen(keys.expected) == 1


async def test_a_renewal_between_a_booking_and_its_flush_counts_it_once(redis_client, unique_name):
    """A router's lease snapshot already holds the changes it has not flushed yet: flushing them
    afterwards too would count them twice (phantom load on a worker until the next renewal)."""
    from router.shared.replica_load import ReplicaLoad

    await _another_replica(redis_client, unique_name)  # its changes are read: flushed
    shared = SharedLoad(redis_client, KeySchema(), "r")
    load = ReplicaLoad(shared, lease_ttl_ms=60_000)
    load.start(lambda: [unique_name])
    replicas = KeySchema().for_model(unique_name).replicas

    async def renewed() -> bool:
        return await redis_client.zscore(replicas, "r") is not None

    async def flushed() -> bool:
        return load.idle()

    try:
        await wait_until(renewed, 5)  # the first renewal is done
        load.book(unique_name, "w", InflightLoad(1, 160, 160))
        await load.renew_all([unique_name])  # within the 2 ms before the booking is flushed
        await wait_until(flushed, 5, interval=0.001)  # the flusher ran after the renewal
        assert await shared.totals(unique_name) == {"w": InflightLoad(1, 160, 160)}
        load.release(unique_name, "w", InflightLoad(1, 160, 160))
        await wait_until(flushed, 5, interval=0.001)
        assert await shared.totals(unique_name) == {}
    finally:
        await load.stop([unique_name])


async def test_a_first_booking_for_a_new_model_counts_at_once(redis_client, unique_name):
    """A replica leases a model on its first booking there, not at its next periodic renewal
    (up to a second later): until then no replica, itself included, saw that load."""
    from router.shared.replica_load import ReplicaLoad

    await _another_replica(redis_client, unique_name)  # its changes are read: flushed
    shared = SharedLoad(redis_client, KeySchema(), "fresh")
    load = ReplicaLoad(shared, lease_ttl_ms=60_000).start(lambda: [])  # knows no model at start

    async def flushed() -> bool:
        return load.idle()

    try:
        load.book(unique_name, "w", InflightLoad(1, 64, 64))
        assert load.carry() is None  # no lease yet: the flush's first snapshot writes it
        await wait_until(flushed, 5, interval=0.001)
        assert await shared.totals(unique_name) == {"w": InflightLoad(1, 64, 64)}
        load.release(unique_name, "w", InflightLoad(0, 0, 64))
        await wait_until(flushed, 5, interval=0.001)
        assert await shared.totals(unique_name) == {"w": InflightLoad(1, 64, 0)}
    finally:
        await load.stop([unique_name])


async def test_a_renewal_waits_for_a_batch_carrying_changes_it_includes(redis_client, unique_name):
    """Changes handed to a decision's batch are in the local truth at once: a lease snapshot
    written before that batch lands would have Redis count them twice (until the next one)."""
    from kvindex.scripts import Scripts
    from router.shared.replica_load import ReplicaLoad

    shared = SharedLoad(redis_client, KeySchema(), "r")
    load = ReplicaLoad(shared, lease_ttl_ms=60_000)
    await _another_replica(redis_client, unique_name)  # decisions carry only what others read
    await load.renew_all([unique_name])  # leased: its changes may be carried
    booked = InflightLoad(1, 160, 160)
    load.book(unique_name, "w", booked, expected=[7])
    calls = _carried_calls(load)  # the batch's writer: a decision, played here by the test
    assert [call.name for call in calls] == ["inflight_add", "expect"]
    assert load.carry() is None and not load.idle()  # handed out once; being written
    renewal = asyncio.create_task(load.renew_all([unique_name]))
    done, _ = await asyncio.wait({renewal}, timeout=0.2)
    assert not done  # it waits for the batch
    load.carried(await Scripts(redis_client).call_many(calls))
    await renewal
    assert load.idle() and load.flushes == 0
    assert await shared.totals(unique_name) == {"w": booked}
    assert await shared.expected(unique_name, [7]) == ["w"]


async def test_a_failed_carrying_batch_is_healed_by_the_next_renewal(redis_client, unique_name):
    from router.shared.replica_load import ReplicaLoad

    shared = SharedLoad(redis_client, KeySchema(), "r")
    load = ReplicaLoad(shared, lease_ttl_ms=60_000)
    await _another_replica(redis_client, unique_name)  # decisions carry only what others read
    await load.renew_all([unique_name])
    load.book(unique_name, "w", InflightLoad(2, 20, 0))
    assert load.carry() is not None
    load.carried(None)  # lost (its decision gave up, or the connection went)
    assert load.idle()
    assert await shared.totals(unique_name) == {}
    await load.renew_all([unique_name])
    assert await shared.totals(unique_name) == {"w": InflightLoad(2, 20, 0)}


async def test_a_booking_keeps_its_expectation_until_settled_for_that_worker_only(redis_client, unique_name):
    """A booked expectation lasts the expected TTL, for this replica and (through Redis) the
    others, until the booking settles it: for the worker it names only, and never for longer."""
    from kvindex.scripts import Scripts
    from router.shared.replica_load import ReplicaLoad

    shared = SharedLoad(redis_client, KeySchema(), "r")
    load = ReplicaLoad(shared, lease_ttl_ms=60_000, expected_ttl_ms=60_000)
    await _another_replica(redis_client, unique_name)  # decisions carry only what others read
    await load.renew_all([unique_name])
    load.book(unique_name, "w", InflightLoad(1, 160, 160), expected=[7])
    load.book(unique_name, "w2", InflightLoad(1, 160, 160), expected=[9])
    calls = _carried_calls(load)
    assert [(c.name, c.args[1]) for c in calls if c.name == "expect"] == [("expect", 60_000)] * 2
    load.carried(await Scripts(redis_client).call_many(calls))
    assert await shared.expected(unique_name, [7, 9]) == ["w", "w2"]
    load.settle_expected(unique_name, "w-other", [7], 0.0)  # another worker's prefill
    assert load.expected_worker(unique_name, 7) == "w"
    load.settle_expected(unique_name, "w2", [9], 30.0)  # within 30 s: not yet
    assert load.expected_worker(unique_name, 9) == "w2"
    load.carried(await Scripts(redis_client).call_many(_carried_calls(load)))
    assert await shared.expected(unique_name, [7, 9]) == ["w", "w2"]
    load.settle_expected(unique_name, "w", [7], 0.0)
    assert load.expected_worker(unique_name, 7) is None
    load.carried(await Scripts(redis_client).call_many(_carried_calls(load)))
    assert await shared.expected(unique_name, [7, 9]) == [None, "w2"]


async def test_settling_ends_only_that_workers_expectation_and_never_extends_one(redis_client, unique_name):
    """settle.lua: blocks still expected on the settling worker lapse within its ttl; a block a
    later decision expects on another worker stays, and a settle asking for longer than an entry
    has left changes nothing (a replayed batch is harmless)."""
    from kvindex.scripts import Scripts

    shared = SharedLoad(redis_client, KeySchema(), "r")
    scripts = Scripts(redis_client)
    await shared.expect(unique_name, "w", [1, 2, 3], 60_000)
    await shared.expect(unique_name, "w2", [3], 60_000)  # a later decision moved block 3
    await shared.expect(unique_name, "w", [4], 200)
    settle = Expectation(unique_name, "w", [1, 2, 3], 0, settled=True)
    longer = Expectation(unique_name, "w", [4], 60_000, settled=True)
    calls = shared.write_calls({}, [settle, longer])
    assert [call.name for call in calls] == ["settle", "settle"]
    assert await scripts.call_many(calls) == [2, 0]
    assert await shared.expected(unique_name, [1, 2, 3, 4]) == [None, None, "w2", "w"]
    assert await scripts.call_many(calls) == [0, 0]  # idempotent

    async def lapsed_as_first_set() -> bool:
        return await shared.expected(unique_name, [4]) == [None]

    await wait_until(lapsed_as_first_set, 5, interval=0.02)


async def test_settling_is_carried_to_redis_with_the_next_batch(redis_client, unique_name):
    from kvindex.scripts import Scripts
    from router.shared.replica_load import ReplicaLoad

    shared = SharedLoad(redis_client, KeySchema(), "r")
    load = ReplicaLoad(shared, lease_ttl_ms=60_000, expected_ttl_ms=60_000)
    await _another_replica(redis_client, unique_name)  # decisions carry only what others read
    await load.renew_all([unique_name])
    load.book(unique_name, "w", InflightLoad(1, 160, 160), expected=[7, 8])
    load.carried(await Scripts(redis_client).call_many(_carried_calls(load)))
    assert await shared.expected(unique_name, [7, 8]) == ["w", "w"]
    load.settle_expected(unique_name, "w", [7, 8], 0.0)
    calls = _carried_calls(load)
    assert [(c.name, c.args[1]) for c in calls] == [("settle", 0)]
    load.carried(await Scripts(redis_client).call_many(calls))
    assert await shared.expected(unique_name, [7, 8]) == [None, None]


async def test_a_replica_alone_writes_its_load_with_its_lease_only_until_another_comes(redis_client, unique_name):
    """Alone on a model (its last lease found no other replica), a replica's changes there are
    written by its lease snapshots only; once another replica reads its load, each change is
    flushed within the window again."""
    from router.shared.replica_load import ReplicaLoad

    shared = SharedLoad(redis_client, KeySchema(), "first")
    load = ReplicaLoad(shared, lease_ttl_ms=60_000, alone_renewal_s=60.0).start(lambda: [])
    try:
        await load.renew_all([unique_name])
        assert shared.alone(unique_name)
        load.book(unique_name, "w1", InflightLoad(1, 10, 10), expected=[7])
        assert load.idle() and load.flushes == 0  # nothing pending: no one would read it
        assert load.expected_worker(unique_name, 7) == "w1"  # this replica's own decisions see it
        assert await shared.totals(unique_name) == {}
        await load.renew_all([unique_name])
        assert await shared.totals(unique_name) == {"w1": InflightLoad(1, 10, 10)}

        await _another_replica(redis_client, unique_name)
        await load.renew_all([unique_name])  # finds the other replica
        assert not shared.alone(unique_name)
        load.book(unique_name, "w2", InflightLoad(1, 20, 20), expected=[9])
        assert not load.idle()

        async def written() -> bool:
            return load.idle()

        await wait_until(written, 10, interval=0.001)
        assert load.flushes == 1
        assert (await shared.totals(unique_name)).get("w2") == InflightLoad(1, 20, 20)
        assert await shared.expected(unique_name, [7, 9]) == [None, "w2"]
    finally:
        await load.stop([unique_name])


async def test_a_replica_alone_finds_a_newcomer_within_a_tenth_of_a_second(redis_client, unique_name):
    """Alone, a replica renews often (not every third of its lease), so that a replica starting
    beside it reads its whole load, and sees its changes, almost at once."""
    from router.shared.replica_load import ReplicaLoad

    shared = SharedLoad(redis_client, KeySchema(), "lone")
    load = ReplicaLoad(shared, lease_ttl_ms=60_000, alone_renewal_s=0.05).start(lambda: [unique_name])
    try:

        async def leased_alone() -> bool:
            return shared.alone(unique_name)

        await wait_until(leased_alone, 5, interval=0.01)
        load.book(unique_name, "w", InflightLoad(1, 10, 10))  # alone: not written yet
        await _another_replica(redis_client, unique_name)

        async def found() -> bool:
            return not shared.alone(unique_name)

        await wait_until(found, 5, interval=0.01)  # a 60 s lease alone would renew every 20 s
        assert await shared.totals(unique_name) == {"w": InflightLoad(1, 10, 10)}
    finally:
        await load.stop([unique_name])


async def test_an_expectation_lasts_as_long_as_its_request(redis_client, unique_name):
    """A booking's expectation stands while its request is in flight, past its first byte (its
    blocks are pinned there), and ends when the request ends, for this replica and, through
    Redis, the others."""
    from kvindex.scripts import Scripts
    from router.routing.booking import Booking
    from router.routing.choice import choose
    from router.routing.decision import Decision
    from router.routing.expectations import checkpoints
    from router.routing.scoring import Candidate, ScoringWeights
    from router.shared.replica_load import ReplicaLoad

    shared = SharedLoad(redis_client, KeySchema(), "r")
    load = ReplicaLoad(shared, lease_ttl_ms=60_000, expected_ttl_ms=60_000)
    await _another_replica(redis_client, unique_name)
    await load.renew_all([unique_name])
    chain = sequence_hashes(list(range(8 * 16)), 16)
    choice = choose([Candidate("w", "http://w")], len(chain), 16, ScoringWeights())
    decision = Decision(unique_name, 8 * 16, 16, chain, choice, False, 0.0)
    booking = Booking(decision, load, streamed=False)
    booking.attempt(choice.chosen)
    depths = checkpoints(len(chain))
    assert [load.expected_worker(unique_name, chain[d - 1]) for d in depths] == ["w"] * len(depths)
    load.carried(await Scripts(redis_client).call_many(_carried_calls(load)))
    assert await shared.expected(unique_name, [chain[-1]]) == ["w"]
    booking.prefilled(choice.chosen)  # the first byte: the request still holds its blocks
    load.carried(await Scripts(redis_client).call_many(_carried_calls(load)))
    assert load.expected_worker(unique_name, chain[-1]) == "w"
    assert await shared.expected(unique_name, [chain[-1]]) == ["w"]
    booking.close()
    assert load.expected_worker(unique_name, chain[-1]) is None
    load.carried(await Scripts(redis_client).call_many(_carried_calls(load)))
    assert await shared.expected(unique_name, [chain[-1]]) == [None]


def _carried_calls(load) -> list:
    """What a decision's batch would carry of ``load``'s pending changes, as script calls (the
    routing port's Redis side turns them into these: kvindex.redis_routing)."""
    pending = load.carry()
    return load.shared.write_calls(*pending) if pending is not None else []
