"""learn.lua and router.routing.model_sync on real Redis servers (each kind, and a Redis Cluster): the
replicas' learned cost models folded into one, applied once per batch, bounded, forgotten."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator

import pytest

from kvindex.cluster import RedisClient
from kvindex.errors import KVIndexError
from kvindex.keys import KeySchema
from kvindex.redis_index import RedisIndex
from kvindex.settings import RedisSettings
from kvindex.shared_load import SharedLoad
from router.routing.model_sync import ModelSync, field_names
from router.routing.ttft import TtftLearner
from tests.conftest import server_kinds
from tests.support import raw_call, wait_until


class Shared(RedisIndex):
    """The index's scripts, and its client for looking at the keys."""

    def __init__(self, client: RedisClient) -> None:
        super().__init__(client)
        self.client = client


@pytest.fixture(params=[*server_kinds(), "cluster"])
async def redis_index(request: pytest.FixtureRequest, redis_servers) -> AsyncIterator[Shared]:
    if request.param == "cluster":
        client = RedisSettings(url=request.getfixturevalue("redis_cluster").url).client()
    else:
        client = RedisSettings(url=redis_servers[request.param].url).client()
    yield Shared(client)
    await client.aclose()


def _replica(index: RedisIndex, name: str, alive: list[str] | None = None, forget_s: float = 600.0) -> ModelSync:
    learners: dict[str, TtftLearner] = {}

    def learner_for(model: str) -> TtftLearner:
        return learners.setdefault(model, TtftLearner())

    workers = ["fast", "slow"] if alive is None else alive
    shared = SharedLoad(index.client, KeySchema(), name, index.scripts)
    return ModelSync(shared, learner_for, lambda _: workers, 1.0, forget_worker_s=forget_s)


def _learn(learner: TtftLearner, count: int, seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(count):
        worker = rng.choice(["fast", "slow"])
        tokens = rng.uniform(100, 4000)
        learner.observe(worker, tokens, 0.01 + (2e-4 if worker == "slow" else 5e-5) * tokens)
        learner.note_busy(0.9)
        learner.note_request(1500)


async def test_a_replica_routes_by_what_another_learned(redis_index, unique_name):
    first, second = _replica(redis_index, "r1"), _replica(redis_index, "r2")
    _learn(first.learner(unique_name), 60, seed=1)
    await first.sync(unique_name)
    await second.sync(unique_name)
    learned, adopted = first.learner(unique_name).model, second.learner(unique_name).model
    assert adopted.utilization == pytest.approx(learned.utilization, rel=1e-9) and adopted.utilization > 0.6
    assert adopted.typical_uncached_tokens == pytest.approx(learned.typical_uncached_tokens, rel=1e-9)
    for worker in ("fast", "slow"):
        assert adopted.params(worker).per_token_s == pytest.approx(learned.params(worker).per_token_s, rel=1e-9)
    assert adopted.params("slow").per_token_s > 2 * adopted.params("fast").per_token_s
    assert second.status.syncs == 1 and second.status.failures == 0


async def test_a_batch_sent_again_is_applied_once(redis_index, unique_name):
    keys = KeySchema().for_model(unique_name)
    args = ["r1", "batch-1", 60_000, 60_000, 0, "a:reuse", "0.9", "0.01", "0.5"]
    first = await redis_index.scripts.run(raw_call("learn", [keys.learned, keys.learned_at], args))
    again = await redis_index.scripts.run(raw_call("learn", [keys.learned, keys.learned_at], args))
    assert first[0] == 1 and again[0] == 0
    assert float(first[2]) == float(again[2]) == pytest.approx(0.5 * 0.9 + 0.01)
    other = await redis_index.scripts.run(
        raw_call("learn", [keys.learned, keys.learned_at], ["r2", "batch-1", *args[2:]])
    )
    assert other[0] == 1 and float(other[2]) == pytest.approx((0.5 * 0.9 + 0.01) * 0.9 + 0.01)  # not r1's batch


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["r", "b", 0, 1000, 0], "forget_after_ms and expire_ms must be positive"),
        (["r", "b", 1000, 1000, 3, "x"], "count of fields to delete"),
        (["r", "b", 1000, 1000, 0, "a:reuse", "1", "0"], "quadruples"),
        (["r", "b", 1000, 1000, 0, "a:reuse", "1", "zero", "0.5"], "is not a field and three numbers"),
        (["r", "b", 1000, 1000, 0, "@r", "1", "0", "0.5"], "is not a field and three numbers"),
    ],
)
async def test_a_malformed_batch_is_refused_and_changes_nothing(redis_index, unique_name, args, message):
    keys = KeySchema().for_model(unique_name)
    with pytest.raises(KVIndexError, match=message):
        await redis_index.scripts.run(raw_call("learn", [keys.learned, keys.learned_at], args))
    assert await redis_index.scripts.run(
        raw_call("learn", [keys.learned, keys.learned_at], ["r", "c", 1000, 1000, 0])
    ) == [1]


async def test_a_lost_model_is_seeded_again_by_the_replicas(redis_index, unique_name):
    first = _replica(redis_index, "r1")
    _learn(first.learner(unique_name), 40, seed=2)
    await first.sync(unique_name)
    learned = first.learner(unique_name).model
    keys = KeySchema().for_model(unique_name)
    await redis_index.client.delete(keys.learned)  # its Redis lost it (a flush, a failover without a replica)
    await first.sync(unique_name)
    await first.sync(unique_name)
    fresh = _replica(redis_index, "r2")
    await fresh.sync(unique_name)
    adopted = fresh.learner(unique_name).model
    assert adopted.utilization == pytest.approx(learned.utilization, rel=1e-9)
    assert adopted.params("slow").per_token_s == pytest.approx(learned.params("slow").per_token_s, rel=1e-9)


async def test_a_worker_gone_long_enough_is_forgotten_everywhere(redis_index, unique_name):
    keeper = _replica(redis_index, "r1")
    _learn(keeper.learner(unique_name), 30, seed=3)
    await keeper.sync(unique_name)
    keys = KeySchema().for_model(unique_name)
    assert await redis_index.client.hexists(keys.learned, field_names(("s", "slow"))[0])
    pruner = _replica(redis_index, "r2", alive=["fast"], forget_s=0.0)
    await pruner.sync(unique_name)  # learns of "slow" from the shared model, sees it is not alive...
    await pruner.sync(unique_name)  # ... and deletes it
    assert not await redis_index.client.hexists(keys.learned, field_names(("s", "slow"))[0])
    assert await redis_index.client.hexists(keys.learned, field_names(("s", "fast"))[0])
    assert "slow" not in pruner.learner(unique_name).worker_ids()


async def test_a_silent_replica_loses_its_batch_marker(redis_index, unique_name):
    keys = KeySchema().for_model(unique_name)
    await redis_index.scripts.run(raw_call("learn", [keys.learned, keys.learned_at], ["gone", "b1", 60_000, 60_000, 0]))
    assert await redis_index.client.hget(keys.learned, "@gone") == b"b1"

    async def forgotten() -> bool:
        await redis_index.scripts.run(raw_call("learn", [keys.learned, keys.learned_at], ["here", "x", 1, 60_000, 0]))
        return await redis_index.client.hget(keys.learned, "@gone") is None

    await wait_until(forgotten, 5)
    assert await redis_index.client.zscore(keys.learned_at, "gone") is None


async def test_a_hash_too_large_is_not_read_back(redis_index, unique_name):
    keys = KeySchema().for_model(unique_name)
    await redis_index.client.hset(keys.learned, mapping={f"junk{i}": 1 for i in range(65_537)})
    reply = await redis_index.scripts.run(
        raw_call("learn", [keys.learned, keys.learned_at], ["r", "b", 1000, 60_000, 0])
    )
    assert reply == [1]


async def test_a_tiers_load_cost_learned_by_one_replica_prices_loads_on_another(redis_index, unique_name):
    first, second = _replica(redis_index, "r1"), _replica(redis_index, "r2")
    teacher = first.learner(unique_name)
    rng = random.Random(7)
    for _ in range(300):
        tokens, loaded = rng.uniform(100, 3000), rng.uniform(256, 4096)
        teacher.observe("fast", tokens, 0.01 + 5e-5 * tokens + 2e-5 * loaded, loaded=("CPU", loaded))
        teacher.observe("fast", tokens, 0.01 + 5e-5 * tokens)
    await first.sync(unique_name)
    await second.sync(unique_name)
    learned = teacher.model.tier_load("CPU")
    assert learned is not None and learned.per_token_s == pytest.approx(2e-5, rel=0.2)
    adopted = second.learner(unique_name).model.tier_load("CPU")
    assert adopted is not None and adopted.per_token_s == pytest.approx(learned.per_token_s)
    assert adopted.wait_s == pytest.approx(learned.wait_s, abs=1e-9)
    assert "t:ly:CPU" in field_names(("t", "CPU"))
