import pytest

from kvindex.codec import pack_hashes, unpack_hashes
from kvindex.keys import KeySchema


@pytest.mark.parametrize("bad", [[-1], [2**64]])
def test_out_of_range_hashes_are_rejected(bad):
    with pytest.raises(ValueError, match="unsigned 64-bit"):
        pack_hashes(bad)


def test_unpack_rejects_partial_hashes():
    with pytest.raises(ValueError, match="8 bytes"):
        unpack_hashes(b"1234567")


def test_hashes_round_trip():
    assert unpack_hashes(pack_hashes([0, 1, 2**64 - 1])) == [0, 1, 2**64 - 1]


def test_script_calls_are_encoded_exactly_as_redis_py_encodes_them():
    from redis.asyncio.connection import Connection

    from kvindex import calls as lua
    from kvindex.pages import pages_of
    from kvindex.scripts import Scripts
    from tests.support import raw_call

    keys = KeySchema().for_model("modèle/ünïcode")
    chain = [0, 1, 2**64 - 1, 0xDEADBEEF]
    connection = Connection()
    scripts = Scripts(None)  # type: ignore[arg-type]
    calls = [
        raw_call("alive", ["k"]),
        lua.page_match(keys, pages_of(chain), chain, chained=True),
        raw_call("relog", ["state:é", "log"], [1, 0, 1, b"\x00" * 8]),
    ]
    expected = connection.pack_commands(
        [
            (
                "EVALSHA_RO" if c.name != "relog" else "EVALSHA",
                scripts._scripts[c.name].sha,
                len(c.keys),
                *c.keys,
                *c.args,
            )
            for c in calls
        ]
    )
    assert b"".join(scripts._pack(connection, calls)) == b"".join(expected)
