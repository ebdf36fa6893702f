import struct

import pytest

from kvindex.codec import encode_adds, encode_subs, pack_hashes, unpack_hashes
from kvindex.mirror import IndexAdd, IndexSub


def test_adds_use_continuation_flags_for_chains():
    args = encode_adds([IndexAdd(10, None, 1), IndexAdd(11, 10, 2), IndexAdd(20, 10, 1)])
    assert args.flags == b"rcp"
    assert unpack_hashes(args.hashes) == [10, 11, 20]
    assert struct.unpack(">3H", args.counts) == (1, 2, 1)
    assert unpack_hashes(args.parents) == [10]


def test_large_counts_are_split_into_items():
    args = encode_adds([IndexAdd(7, 3, 70_000)])
    assert args.flags == b"pp"
    assert struct.unpack(">2H", args.counts) == (65535, 4465)
    hashes, counts = encode_subs([IndexSub(7, 65_536)])
    assert unpack_hashes(hashes) == [7, 7]
    assert struct.unpack(">2H", counts) == (65535, 1)


@pytest.mark.parametrize("bad", [[-1], [2**64]])
def test_out_of_range_hashes_are_rejected(bad):
    with pytest.raises(ValueError, match="unsigned 64-bit"):
        pack_hashes(bad)


def test_unpack_rejects_partial_hashes():
    with pytest.raises(ValueError, match="8 bytes"):
        unpack_hashes(b"1234567")
