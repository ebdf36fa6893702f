"""router.prompts.hashing: long prompts hashed in slices give sequence_hashes' result and yield."""

from __future__ import annotations

import asyncio
import random
from array import array

import pytest

from kvindex.hashing import sequence_hashes
from kvindex.prefix_memo import PrefixHashMemo
from router.prompts.hashing import PromptHasher


def _tokens(count: int, seed: int = 1) -> array:
    rng = random.Random(seed)
    return array("I", (rng.randrange(50_000) for _ in range(count)))


@pytest.mark.parametrize("memo_max_blocks", [0, 10_000])  # plain slices; slices through the memo
@pytest.mark.parametrize("count", [0, 15, 16, 64, 65, 1000, 4099])
@pytest.mark.parametrize("salt", [None, "tenant-a"])
async def test_slices_give_the_same_hashes_as_one_pass(memo_max_blocks, count, salt):
    hasher = PromptHasher(PrefixHashMemo(segment_blocks=2), slice_blocks=4, memo_max_blocks=memo_max_blocks)
    tokens = _tokens(count)
    expected = sequence_hashes(tokens, 16, cache_salt=salt)
    assert await hasher.chain(tokens, 16, salt) == expected
    assert await hasher.chain(list(tokens), 16, salt) == expected  # a list as well as an array
    assert await hasher.chain(tokens, 16, salt) == expected  # again: from the memo where used


async def test_a_prompt_sharing_a_remembered_prefix_is_hashed_correctly_past_it():
    hasher = PromptHasher(PrefixHashMemo(segment_blocks=2), slice_blocks=4, memo_max_blocks=10_000)
    first = _tokens(800, seed=2)
    second = array("I", [*first[:500], *_tokens(300, seed=3)])
    await hasher.chain(first, 16)
    assert await hasher.chain(second, 16) == sequence_hashes(second, 16)
    assert hasher.memo.hits > 0


async def test_a_long_prompt_yields_to_the_event_loop_between_slices():
    hasher = PromptHasher(PrefixHashMemo(), slice_blocks=8, memo_max_blocks=0)
    task = asyncio.create_task(hasher.chain(_tokens(16 * 64), 16))
    await asyncio.sleep(0)  # the task starts and hashes its first slice
    for _ in range(3):  # other work runs between slices while the prompt is still being hashed
        assert hasher.in_progress == 1 and not task.done()
        await asyncio.sleep(0)
    assert len(await task) == 64 and hasher.in_progress == 0 and hasher.sliced == 1


async def test_a_short_prompt_is_hashed_at_once():
    hasher = PromptHasher(PrefixHashMemo(), slice_blocks=8)
    assert await hasher.chain(_tokens(16 * 8), 16) == sequence_hashes(_tokens(16 * 8), 16)
    assert hasher.sliced == 0
