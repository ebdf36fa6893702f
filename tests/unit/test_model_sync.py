"""Sharing the learned cost model between replicas (router.routing.model_sync, router.routing.ttft): the
arithmetic of learn.lua done here in Python, so that the algebra is checked apart from Redis
(tests/index/test_model_sync.py runs the script itself)."""

from __future__ import annotations

import random

import pytest

from router.routing.model_sync import batch_args, field_names, parse_model
from router.routing.ttft import GroupChange, TtftLearner


class Store:
    """learn.lua's arithmetic: value = (value, or base when missing) * factor + delta, a batch
    id applied once per replica."""

    def __init__(self) -> None:
        self.fields: dict[str, float] = {}
        self.last: dict[str, str] = {}

    def learn(self, replica: str, batch_id: str, changes: list[GroupChange]) -> list:
        args = batch_args(changes, [])
        if self.last.get(replica) != batch_id:
            for i in range(1, len(args), 4):
                name, factor, delta, base = args[i], *map(float, args[i + 1 : i + 4])
                self.fields[name] = self.fields.get(name, base) * factor + delta
            self.last[replica] = batch_id
        return [1, *(x for item in self.fields.items() for x in (item[0], repr(item[1])))]

    def sync(self, replica: str, learner: TtftLearner, batch_id: str) -> None:
        changes = learner.changes()
        learner.adopt(changes, parse_model(self.learn(replica, batch_id, changes))[1])


def _observe(learners: list[TtftLearner], rng: random.Random, worker: str) -> None:
    tokens = rng.uniform(0, 4000)
    seconds = (0.01 + (2e-4 if worker == "slow" else 5e-5) * tokens) * rng.uniform(0.9, 1.1)
    busy, cached, uncached = rng.random(), rng.uniform(0, 1000), rng.uniform(0, 2000)
    for learner in learners:
        learner.observe(worker, tokens, seconds)
        learner.note_busy(busy)
        learner.note_usage(1000, int(cached))
        learner.note_request(uncached)


def _assert_same_model(one: TtftLearner, other: TtftLearner) -> None:
    a, b = one.model, other.model
    assert a.fleet.base_s == pytest.approx(b.fleet.base_s, rel=1e-6, abs=1e-9)
    assert a.fleet.per_token_s == pytest.approx(b.fleet.per_token_s, rel=1e-6)
    for worker in ("fast", "slow"):
        assert a.params(worker).per_token_s == pytest.approx(b.params(worker).per_token_s, rel=1e-6)
    assert (a.utilization, a.reuse, a.typical_uncached_tokens) == pytest.approx(
        (b.utilization, b.reuse, b.typical_uncached_tokens), rel=1e-6
    )
    assert one.snapshot()["observations"] == pytest.approx(other.snapshot()["observations"], rel=1e-6)


def test_replicas_that_share_learn_what_one_replica_seeing_every_request_learns():
    rng = random.Random(7)
    a, b, alone = TtftLearner(), TtftLearner(), TtftLearner()
    store = Store()
    for round_ in range(30):
        for _ in range(rng.randint(0, 6)):
            _observe([a, alone], rng, rng.choice(["fast", "slow"]))
        store.sync("a", a, f"a{round_}")  # the store saw a's batch first...
        for _ in range(rng.randint(0, 6)):
            _observe([b, alone], rng, rng.choice(["fast", "slow"]))
        store.sync("b", b, f"b{round_}")  # ... then b's, as "alone" did
    store.sync("a", a, "a-last")
    _assert_same_model(a, alone)
    _assert_same_model(b, alone)
    assert a.model.utilization != pytest.approx(TtftLearner().model.utilization, abs=1e-3)  # it learned


def test_what_is_learned_while_a_batch_is_out_is_kept_on_top_of_the_shared_model():
    rng = random.Random(3)
    a, alone = TtftLearner(), TtftLearner()
    store = Store()
    for _ in range(10):
        _observe([a, alone], rng, "fast")
    batch = a.changes()
    store.learn("a", "a1", batch)  # applied, but the reply is lost...
    for _ in range(5):
        _observe([a, alone], rng, "slow")  # ... while these come in
    reply = store.learn("a", "a1", batch)  # resent as it was: not applied twice
    a.adopt(batch, parse_model(reply)[1])
    _assert_same_model(a, alone)
    store.sync("a", a, "a2")  # the five later ones go with the next batch
    fresh = TtftLearner()
    store.sync("new", fresh, "n1")  # a new replica starts from the fleet's model
    _assert_same_model(fresh, alone)


def test_a_lost_shared_model_is_seeded_again_from_what_a_replica_last_saw():
    rng = random.Random(5)
    a, alone = TtftLearner(), TtftLearner()
    store = Store()
    for _ in range(20):
        _observe([a, alone], rng, rng.choice(["fast", "slow"]))
    store.sync("a", a, "a1")
    store.fields.clear()  # Redis lost the hash
    for _ in range(3):
        _observe([a, alone], rng, "fast")
    store.sync("a", a, "a2")  # what changed since; the reply shows what the store lost...
    store.sync("a", a, "a3")  # ... which the next batch seeds again
    fresh = TtftLearner()
    store.sync("new", fresh, "n1")
    _assert_same_model(fresh, alone)
    _assert_same_model(a, alone)


def test_parse_model_takes_complete_groups_of_numbers_and_skips_the_rest():
    sums = field_names(("s", "http://w:8000"))
    flat = [x for i, name in enumerate(sums) for x in (name, str(i + 1))]
    reply = [1, *flat, "a:reuse", "0.25", "a:typical", "nan", "S:n", "3", "x:junk", "1", "a:utilization", "high"]
    applied, groups = parse_model([x.encode() if isinstance(x, str) else x for x in reply])
    assert applied is True
    assert groups == {("s", "http://w:8000"): tuple(float(i + 1) for i in range(len(sums))), ("a", "reuse"): (0.25,)}


def test_field_names_keep_worker_ids_with_colons_whole():
    assert field_names(("a", "reuse")) == ["a:reuse"]
    assert field_names(("S", ""))[0] == "S:n"
    assert field_names(("w", "h:1"))[-1] == "w:yy:h:1"
