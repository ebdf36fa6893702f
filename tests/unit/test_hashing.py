import struct

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from kvindex.hashing import (
    HASH_SEED,
    block_local_hashes,
    chain_hashes,
    extend_sequence_hashes,
    identity_tag,
    sequence_hashes,
)

# Published by NVIDIA Dynamo for tokens [1, 2, 3, 4], block size 4.
DYNAMO_LOCAL_1234 = 14643705804678351452


def test_dynamo_published_vector():
    assert block_local_hashes([1, 2, 3, 4], 4) == [DYNAMO_LOCAL_1234]
    assert sequence_hashes([1, 2, 3, 4], 4) == [DYNAMO_LOCAL_1234]


def test_chain_rule_matches_definition():
    tokens = list(range(1, 13))
    locals_ = [xxhash.xxh3_64_intdigest(struct.pack("<4I", *tokens[i : i + 4]), seed=1337) for i in (0, 4, 8)]
    seq1 = xxhash.xxh3_64_intdigest(struct.pack("<QQ", locals_[0], locals_[1]), seed=1337)
    seq2 = xxhash.xxh3_64_intdigest(struct.pack("<QQ", seq1, locals_[2]), seed=1337)
    assert sequence_hashes(tokens, 4) == [locals_[0], seq1, seq2]
    assert HASH_SEED == 1337


def test_pinned_vectors_from_docs():
    # The vectors printed in docs/hashing.md; a change here is a breaking change of the index.
    assert sequence_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4) == [14643705804678351452, 4945711292740353085]
    assert sequence_hashes([1, 2, 3, 4], 4, cache_salt="tenant-a") == [747311281375567057]
    assert sequence_hashes([1, 2, 3, 4], 4, lora_name="sql-lora") == [6853679293932027201]


def test_partial_tail_block_is_not_hashed():
    assert len(sequence_hashes(list(range(11)), 4)) == 2
    assert sequence_hashes(list(range(11)), 4) == sequence_hashes(list(range(8)), 4)
    assert sequence_hashes([1, 2, 3], 4) == []


def test_identity_separates_caches_from_the_first_block_on():
    tokens = list(range(64))
    plain = sequence_hashes(tokens, 16)
    salted_a = sequence_hashes(tokens, 16, cache_salt="a")
    salted_b = sequence_hashes(tokens, 16, cache_salt="b")
    lora = sequence_hashes(tokens, 16, lora_name="a")
    assert len({*plain, *salted_a, *salted_b, *lora}) == 16
    assert identity_tag(None, None) is None
    assert identity_tag("", "") is None
    # Length-prefixing: moving a character between LoRA name and salt changes the identity.
    assert identity_tag("ab", "c") != identity_tag("a", "bc")


@given(
    st.lists(st.integers(0, 2**32 - 1), max_size=200),
    st.integers(1, 16),
    st.integers(0, 12),
    st.one_of(st.none(), st.text(max_size=5)),
)
def test_extending_a_chain_equals_hashing_the_whole_prompt(tokens, block_size, cut_blocks, salt):
    whole = sequence_hashes(tokens, block_size, cache_salt=salt)
    cut = min(cut_blocks, len(whole))
    head = sequence_hashes(tokens[: cut * block_size], block_size, cache_salt=salt)
    parent = head[-1] if head else None
    tail = extend_sequence_hashes(parent, tokens[cut * block_size :], block_size, cache_salt=salt)
    assert head + tail == whole
    assert chain_hashes(block_local_hashes(tokens, block_size), identity_tag(None, salt)) == whole


@pytest.mark.parametrize("bad", [[-1], [2**32], ["a"], [1.5]])
def test_bad_token_ids_are_rejected(bad):
    with pytest.raises(ValueError, match="token ids"):
        sequence_hashes(bad * 4, 4)


def test_bad_block_size_is_rejected():
    with pytest.raises(ValueError, match="block_size"):
        sequence_hashes([1, 2, 3, 4], 0)
