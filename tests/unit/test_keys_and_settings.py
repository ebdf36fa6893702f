import random

import pytest
from redis.crc import key_slot

from kvindex.keys import BUCKETS, KeySchema, bucket_of
from kvindex.settings import RedisSettings


def test_control_keys_share_the_model_tag_and_bucket_keys_their_buckets():
    keys = KeySchema("kvr").for_model("meta-llama/Llama-3.1-8B")
    control = [
        keys.meta,
        keys.workers,
        keys.gids,
        keys.alive,
        keys.retired,
        keys.gid_buckets(17),
        keys.worker("http://10.0.0.1:8000#0"),
        keys.replicas,
        keys.inflight("r1"),
        keys.expected,
    ]
    assert {key_slot(n.encode()) for n in control} == {key_slot(b"meta-llama/Llama-3.1-8B")}
    bucket = keys.bucket(0x2A)
    assert bucket.block(255) == "kvr:{meta-llama/Llama-3.1-8B#02a}:b:00000000000000ff"
    names = [bucket.block(2**64 - 1), bucket.log(17), bucket.state(17)]
    assert {key_slot(n.encode()) for n in names} == {key_slot(b"meta-llama/Llama-3.1-8B#02a")}


def test_buckets_spread_roots_evenly_even_when_hashes_are_small_integers():
    counts = [0] * BUCKETS
    for root in range(64 * BUCKETS):
        counts[bucket_of(root)] += 1
    assert min(counts) >= 32 and max(counts) <= 96  # 64 each on average
    assert len({bucket_of(random.Random(seed).getrandbits(64)) for seed in range(4000)}) > 0.9 * BUCKETS
    assert KeySchema().for_model("m").bucket_of_chain(12345) == KeySchema().for_model("m").bucket(bucket_of(12345))


@pytest.mark.parametrize("model", ["", "bad\nname", "x" * 600])
def test_bad_model_names_are_rejected(model):
    with pytest.raises(ValueError, match="model name"):
        KeySchema().for_model(model)


def test_prefix_may_not_move_the_hash_tag():
    with pytest.raises(ValueError, match="braces"):
        KeySchema("kv{r}")
    with pytest.raises(ValueError, match="block hash"):
        KeySchema().for_model("m").bucket(0).block(-1)
    with pytest.raises(ValueError, match="bucket"):
        KeySchema().for_model("m").bucket(BUCKETS)


def test_settings_hide_the_password_and_read_the_environment():
    settings = RedisSettings.from_env({"KVROUTE_REDIS_URL": "redis://:s3cret@db:6380/1", "KVROUTE_PREFIX": "p"})
    assert settings.prefix == "p"
    assert "s3cret" not in repr(settings)
    assert "***" in repr(settings)
    assert RedisSettings.from_env({"KVROUTE_PREFIX": "p"}, prefix="q").prefix == "q"
    with pytest.raises(ValueError, match="redis://"):
        RedisSettings(url="http://x")


def test_redis_variables_follow_the_flag_then_variable_then_default_rule():
    env = {"KVROUTE_REDIS_URL": "", "KVROUTE_PREFIX": "team", "KVROUTE_REDIS_READ_FROM_REPLICAS": "off"}
    settings = RedisSettings.from_env(env)
    assert (settings.url, settings.prefix, settings.read_from_replicas) == ("redis://127.0.0.1:6379/0", "team", False)
    assert RedisSettings.from_env(env, prefix="flag").prefix == "flag"
    cluster = {"KVROUTE_REDIS_URL": "redis+cluster://h:7000", "KVROUTE_REDIS_READ_FROM_REPLICAS": "yes"}
    assert RedisSettings.from_env(cluster).read_from_replicas is True
    with pytest.raises(ValueError, match=r"^KVROUTE_REDIS_READ_FROM_REPLICAS must be 1 or 0 .*'maybe'"):
        RedisSettings.from_env({"KVROUTE_REDIS_READ_FROM_REPLICAS": "maybe"})
