import pytest

from kvindex.codec import encode_adds, encode_ops, encode_subs, pack_hashes, unpack_hashes
from kvindex.mirror import IndexAdd, IndexSub


def test_adds_use_continuation_flags_for_chains():
    args = encode_adds([IndexAdd(10, None), IndexAdd(11, 10), IndexAdd(20, 10)])
    assert args.flags == b"rcp"
    assert unpack_hashes(args.hashes) == [10, 11, 20]
    assert unpack_hashes(args.parents) == [10]


def test_ops_become_segments_of_one_kind_in_their_order():
    kinds, args = encode_ops([IndexAdd(1, None), IndexAdd(2, 1), IndexSub(2), IndexSub(1), IndexAdd(1, None)])
    assert kinds == b"asa"
    assert [len(a) for a in args] == [16, 2, 0, 16, 8, 1, 0]
    assert unpack_hashes(args[3]) == [2, 1]
    assert encode_subs([IndexSub(7)]) == pack_hashes([7])


@pytest.mark.parametrize("bad", [[-1], [2**64]])
def test_out_of_range_hashes_are_rejected(bad):
    with pytest.raises(ValueError, match="unsigned 64-bit"):
        pack_hashes(bad)


def test_unpack_rejects_partial_hashes():
    with pytest.raises(ValueError, match="8 bytes"):
        unpack_hashes(b"1234567")
