"""router.prompts.id_memo: token-id prompts decoded only past the text already seen, always exactly."""

from __future__ import annotations

import asyncio
import json
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.prompts.body import SLICE_BYTES, BodyError, decode_prompt
from router.prompts.id_memo import TokenIdMemo

U32 = st.integers(min_value=0, max_value=2**32 - 1)
SEPARATORS = st.sampled_from([",", ", ", " , ", ",\n  ", "\t,"])


def _text(ids: list[int], separator: str = ", ", inside: str = "") -> bytes:
    return f"[{inside}{separator.join(map(str, ids))}{inside}]".encode()


async def _through(raw: bytes, memo: TokenIdMemo | None) -> object:
    try:
        return await decode_prompt(raw, 10**7, memo)
    except BodyError as exc:
        return ("error", exc.status, str(exc))


@settings(max_examples=60, deadline=None)
@given(
    shared=st.lists(U32, min_size=0, max_size=400),
    tails=st.lists(
        st.tuples(st.integers(0, 400), st.lists(U32, max_size=150), SEPARATORS, st.sampled_from(["", " "])),
        min_size=1,
        max_size=8,
    ),
)
def test_prompts_sharing_prefixes_decode_to_their_exact_ids(shared, tails):
    memo = TokenIdMemo(chunk_bytes=64)

    async def run() -> None:
        for keep, tail, separator, inside in tails:
            ids = shared[:keep] + tail
            got = await decode_prompt(_text(ids, separator, inside), 10**7, memo)
            assert list(got) == ids  # an array('I') through the memo, a list when too short for it

    asyncio.run(run())


async def test_a_seen_prefix_is_taken_from_the_memo_and_only_the_rest_decoded():
    memo = TokenIdMemo(chunk_bytes=256)
    shared = list(range(1000, 3000))
    first = await decode_prompt(_text([*shared, 7, 8, 9]), 10**7, memo)
    assert first == array("I", [*shared, 7, 8, 9]) and memo.hits == 0 and memo.misses == len(shared) + 3
    second = await decode_prompt(_text([*shared, 4, 5]), 10**7, memo)
    assert second == array("I", [*shared, 4, 5])
    # Every piece before the last cut inside the shared text came from the memo (a piece is
    # ~256 bytes: 51 ids of 4 digits and a separator).
    assert len(shared) - 2 * 52 < memo.hits < len(shared)
    assert memo.misses == len(shared) + 3 + (len(shared) + 2 - memo.hits)


@pytest.mark.parametrize(
    "values",
    [
        [[1, 2], [3, 4]],  # a batch
        ["one", "two"],
        [1.5, 2],
        [True, 3],
        [-1, 2],
        [2**32, 1],
        [2**70, 1],
        [None, 1],
        [{"a": 1}],
    ],
)
async def test_what_is_not_u32_ids_decodes_as_without_the_memo(values):
    filler = list(range(100, 400))
    for raw in (_text(values + filler), _text(filler + values), json.dumps(filler + values).encode()):
        assert await _through(raw, TokenIdMemo(chunk_bytes=64)) == await _through(raw, None)


async def test_a_remembered_prefix_with_a_bad_rest_decodes_as_without_the_memo():
    memo = TokenIdMemo(chunk_bytes=64)
    shared = list(range(100, 400))
    await decode_prompt(_text([*shared, 1]), 10**7, memo)
    for rest in ("1.5", "true", "-3", "4294967296", '"x"', "[1]"):
        raw = _text(shared).rstrip(b"]") + b", " + rest.encode() + b"]"
        assert await _through(raw, memo) == await _through(raw, None)
    assert memo.hits > 0


async def test_a_long_prompt_through_the_memo_is_its_ids():
    memo = TokenIdMemo()
    shared = [(i * 7919) % 200_000 for i in range(SLICE_BYTES // 5)]
    for tail in ([1, 2, 3], [4, 5]):
        raw = _text(shared + tail)
        assert len(raw) > SLICE_BYTES
        assert await decode_prompt(raw, 10**7, memo) == array("I", shared + tail)
    assert memo.hits > len(shared) // 2


async def test_the_memo_holds_at_most_its_bound():
    memo = TokenIdMemo(chunk_bytes=64, max_ids=500)
    for start in range(0, 20_000, 1000):
        ids = list(range(start, start + 1000))
        assert await decode_prompt(_text(ids), 10**7, memo) == array("I", ids)
    held = sum(len(piece) for piece in memo._pieces.values())
    assert 400 < held <= 500
    await decode_prompt(_text(list(range(19_000, 20_000))), 10**7, memo)  # the newest: its start kept
    assert 400 < memo.hits <= 500
    hits = memo.hits
    await decode_prompt(_text(list(range(0, 1000))), 10**7, memo)  # the oldest: forgotten
    assert memo.hits == hits


@given(st.binary(min_size=0, max_size=600).map(lambda b: b"[" + b.replace(b"]", b"") + b"]"))
def test_cuts_are_the_first_comma_past_each_multiple_of_a_chunk(raw):
    memo = TokenIdMemo(chunk_bytes=32)
    cuts = memo.cuts(raw)
    firsts = {raw.find(b",", m) for m in range(32, len(raw), 32)} - {-1}
    assert cuts == sorted(firsts)  # each once, in order; nothing else


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError):
        TokenIdMemo(chunk_bytes=0)
    with pytest.raises(ValueError):
        TokenIdMemo(max_ids=0)
