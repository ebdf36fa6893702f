import pytest
from redis.crc import key_slot

from kvindex.keys import KeySchema
from kvindex.settings import RedisSettings


def test_every_model_key_shares_the_model_hash_tag():
    keys = KeySchema("kvr").for_model("meta-llama/Llama-3.1-8B")
    names = [
        keys.meta,
        keys.workers,
        keys.gids,
        keys.alive,
        keys.retired,
        keys.gc_cursors,
        keys.worker("http://10.0.0.1:8000#0"),
        keys.log(17),
        keys.block(2**64 - 1),
    ]
    assert {key_slot(n.encode()) for n in names} == {key_slot(b"meta-llama/Llama-3.1-8B")}
    assert keys.block(255) == "kvr:{meta-llama/Llama-3.1-8B}:b:00000000000000ff"


@pytest.mark.parametrize("model", ["", "bad\nname", "x" * 600])
def test_bad_model_names_are_rejected(model):
    with pytest.raises(ValueError, match="model name"):
        KeySchema().for_model(model)


def test_prefix_may_not_move_the_hash_tag():
    with pytest.raises(ValueError, match="braces"):
        KeySchema("kv{r}")
    with pytest.raises(ValueError, match="block hash"):
        KeySchema().for_model("m").block(-1)


def test_settings_hide_the_password_and_read_the_environment():
    settings = RedisSettings.from_env({"KVROUTE_REDIS_URL": "redis://:s3cret@db:6380/1", "KVROUTE_PREFIX": "p"})
    assert settings.prefix == "p"
    assert "s3cret" not in repr(settings)
    assert "***" in repr(settings)
    assert RedisSettings.from_env({"KVROUTE_PREFIX": "p"}, prefix="q").prefix == "q"
    with pytest.raises(ValueError, match="redis://"):
        RedisSettings(url="http://x")
