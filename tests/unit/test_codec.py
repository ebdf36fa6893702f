import pytest

from kvindex.codec import KeyRun, encode_adds, encode_ops, pack_hashes, unpack_hashes
from kvindex.keys import KeySchema
from kvindex.mirror import IndexAdd, IndexSub

BUCKET = KeySchema().for_model("m").bucket(7)


def test_adds_use_continuation_flags_for_chains():
    args = encode_adds([IndexAdd(10, None, 10), IndexAdd(11, 10, 10), IndexAdd(20, 10, 10)])
    assert args.flags == b"rcp"
    assert unpack_hashes(args.hashes) == [10, 11, 20]
    assert args.parents == [10]


def test_ops_become_segments_of_one_kind_in_their_order_with_every_key_declared():
    ops = [IndexAdd(1, None, 1), IndexAdd(2, 1, 1), IndexSub(2, 1), IndexSub(1, 1), IndexAdd(3, 1, 1)]
    kinds, blocks, args = encode_ops(ops)
    assert kinds == b"asa"
    # a segment's items, then the parents of its 'p' items; the subtractions' items
    assert blocks == [1, 2, 2, 1, 3, 1]
    assert args == [pack_hashes([1, 2]), b"rc", 2, pack_hashes([3]), b"p"]
    keys = KeyRun(BUCKET.block_prefix, blocks, lead=["state", "log"])
    assert list(keys) == ["state", "log", *(BUCKET.block(h) for h in blocks)] and len(keys) == 8


@pytest.mark.parametrize("bad", [[-1], [2**64]])
def test_out_of_range_hashes_are_rejected(bad):
    with pytest.raises(ValueError, match="unsigned 64-bit"):
        pack_hashes(bad)


def test_unpack_rejects_partial_hashes():
    with pytest.raises(ValueError, match="8 bytes"):
        unpack_hashes(b"1234567")


def test_a_key_run_is_encoded_exactly_as_redis_py_encodes_its_keys():
    from redis.asyncio.connection import Connection

    from kvindex.codec import KeyRun
    from kvindex.scripts import Scripts
    from tests.support import raw_call

    chain = [0, 1, 2**64 - 1, 0xDEADBEEF]
    prefix = KeySchema().for_model("modèle/ünïcode").bucket_of_chain(chain[0]).block_prefix
    run = KeyRun(prefix, chain)
    assert list(run) == [f"{prefix}{h:016x}" for h in chain] and len(run) == 4 and run[2] == f"{prefix}{2**64 - 1:x}"
    connection = Connection()
    scripts = Scripts(None)  # type: ignore[arg-type]
    calls = [
        raw_call("alive", ["k"]),
        raw_call("match", run, ["extra", 7]),
        raw_call("match", KeyRun(prefix, [])),
        raw_call("apply", KeyRun(prefix, chain, lead=["state:é", "log"]), [1, 0, 1, b"s", 4]),
    ]
    expected = connection.pack_commands(
        [
            (
                "EVALSHA_RO" if c.name != "apply" else "EVALSHA",
                scripts._scripts[c.name].sha,
                len(c.keys),
                *c.keys,
                *c.args,
            )
            for c in calls
        ]
    )
    assert b"".join(scripts._pack(connection, calls)) == b"".join(expected)
