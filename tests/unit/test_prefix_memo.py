"""The prefix memo must give exactly sequence_hashes' answer, whatever it remembers."""

from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvindex.hashing import sequence_hashes
from kvindex.prefix_memo import PrefixHashMemo

token = st.integers(min_value=0, max_value=0xFFFFFFFF)
prompt = st.lists(st.integers(min_value=0, max_value=50), max_size=120)


@settings(max_examples=200)
@given(
    shared=st.lists(token, max_size=100),
    tails=st.lists(prompt, min_size=1, max_size=6),
    block_size=st.sampled_from([1, 2, 4, 16]),
    segment_blocks=st.sampled_from([1, 2, 3, 8]),
    max_segments=st.sampled_from([1, 4, 1000]),
    salt=st.sampled_from([None, "tenant-a", "tenant-b"]),
)
def test_memo_equals_sequence_hashes(shared, tails, block_size, segment_blocks, max_segments, salt):
    memo = PrefixHashMemo(segment_blocks, max_segments)
    for tail in tails:
        tokens = shared + tail
        expected = sequence_hashes(tokens, block_size, cache_salt=salt)
        assert memo.sequence_hashes(tokens, block_size, cache_salt=salt) == expected
        assert memo.sequence_hashes(array("I", tokens), block_size, cache_salt=salt) == expected
        assert len(memo) <= max_segments


def test_shared_prefixes_are_hashed_once():
    memo = PrefixHashMemo(segment_blocks=4)
    system = list(range(1000, 1000 + 64 * 16))  # 64 blocks
    memo.sequence_hashes(system + [1] * 40, 16)
    hashed_first = memo.misses
    assert hashed_first == 66 and memo.hits == 0
    memo.sequence_hashes(system + [2] * 40, 16)
    assert memo.hits == 64  # every segment of the shared 64 blocks
    assert memo.misses == hashed_first + 2


def test_identity_and_block_size_separate_entries():
    memo = PrefixHashMemo(segment_blocks=1)
    tokens = list(range(64))
    memo.sequence_hashes(tokens, 16)
    assert memo.sequence_hashes(tokens, 16, cache_salt="x") == sequence_hashes(tokens, 16, cache_salt="x")
    assert memo.sequence_hashes(tokens, 8) == sequence_hashes(tokens, 8)
    assert memo.hits == 0


def test_bad_input_is_rejected():
    memo = PrefixHashMemo()
    with pytest.raises(ValueError, match="token ids"):
        memo.sequence_hashes([1, -2, 3], 1)
    with pytest.raises(ValueError, match="block_size"):
        memo.sequence_hashes([1, 2], 0)
    with pytest.raises(ValueError):
        PrefixHashMemo(segment_blocks=0)
