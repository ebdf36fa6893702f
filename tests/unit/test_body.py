"""router.prompts.body: the fields the router reads, a long token-id prompt decoded in slices."""

from __future__ import annotations

import asyncio
import json
from array import array

import pytest

from kvtokens.sampling import SAMPLING_FIELDS
from router.prompts.body import SLICE_BYTES, TOO_DEEP, BodyError, Fields, decode_token_answer, parse_body

LONG = [(i * 7919) % 200_000 for i in range(3 * SLICE_BYTES // 6)]  # ~3 slices of ids


async def _decode(body: object, limit: int = 10**7) -> dict:
    return await parse_body(json.dumps(body).encode(), limit)


@pytest.mark.parametrize(
    "prompt",
    ["a text", [1, 2, 3], ["one", "two"], [[1, 2], [3]], None, "x" * (2 * SLICE_BYTES), ["y" * (2 * SLICE_BYTES)]],
)
async def test_short_and_non_id_prompts_decode_as_json_does(prompt):
    body = {"model": "m", "prompt": prompt, "stream": True, "unread": {"deep": [1, {"x": 2}]}}
    assert await _decode(body) == {"model": "m", "prompt": prompt, "stream": True}


async def test_a_long_token_id_prompt_becomes_an_array_of_the_same_ids():
    decoded = await _decode({"model": "m", "prompt": LONG, "cache_salt": "s"})
    assert decoded["prompt"] == array("I", LONG) and decoded["cache_salt"] == "s"
    spaced = b'{"model": "m", "prompt": [ ' + b" ,  ".join(str(t).encode() for t in LONG) + b" ] }"
    assert (await parse_body(spaced, 10**7))["prompt"] == array("I", LONG)


async def test_of_a_long_batch_only_the_first_prompt_is_decoded():
    decoded = await _decode({"model": "m", "prompt": [LONG, [5, 6], LONG[:10]]})
    assert decoded["prompt"] == [array("I", LONG)]


async def test_absent_fields_stay_absent_and_null_ones_present():
    assert await _decode({"model": "m", "messages": None}) == {"model": "m", "messages": None}
    assert await _decode({}) == {}


async def test_a_long_prompt_over_the_limit_is_413_before_it_is_decoded():
    with pytest.raises(BodyError) as error:
        await _decode({"model": "m", "prompt": LONG}, limit=len(LONG) - 1)
    assert error.value.status == 413
    assert str(error.value) == (
        f"the prompt has {len(LONG)} tokens; this router accepts at most {len(LONG) - 1} (--max-prompt-tokens)"
    )


@pytest.mark.parametrize("bad", [-1, 2**32, 1.5, True])
async def test_a_bad_id_in_a_long_prompt_is_one_line(bad):
    with pytest.raises(BodyError, match=r"^token ids must be integers in 0\.\.4294967295$") as error:
        await _decode({"model": "m", "prompt": [*LONG, bad]})
    assert error.value.status == 400


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"[1, 2]", "the request body must be a JSON object"),
        (b"{not json", "the request body is not valid JSON: "),
        (b'{"model": "m"} trailing', "the request body is not valid JSON: "),
        (b"[" * 100_000 + b"]" * 100_000, None),  # the top level is checked first: not an object
        (b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", TOO_DEEP),
    ],
)
async def test_unreadable_bodies_are_one_line(raw, message):
    with pytest.raises(BodyError) as error:
        await parse_body(raw, 10**7)
    assert "\n" not in str(error.value) and error.value.status == 400
    if message is not None:
        assert str(error.value).startswith(message)


async def test_a_long_prompt_yields_to_the_event_loop_between_slices():
    task = asyncio.create_task(_decode({"model": "m", "prompt": LONG}))
    await asyncio.sleep(0)  # the task decodes its first slice and yields
    await asyncio.sleep(0)
    assert not task.done()
    assert (await task)["prompt"] == array("I", LONG)


async def test_a_tokenize_answer_gives_its_ids_as_an_array_long_or_short():
    answer = {"count": len(LONG), "max_model_len": 4096, "tokens": LONG, "token_strs": None}
    assert await decode_token_answer(json.dumps(answer).encode(), 10**7) == array("I", LONG)
    assert await decode_token_answer(b'{"tokens": [3, 4]}', 10) == array("I", [3, 4])


@pytest.mark.parametrize(
    ("raw", "limit", "status"),
    [(b'{"tokens": [1, 2, 3]}', 2, 413), (b"{}", 10, 400), (b'{"tokens": "x"}', 10, 400), (b"[]", 10, 400)],
)
async def test_a_tokenize_answer_without_usable_ids_is_an_error(raw, limit, status):
    with pytest.raises(BodyError) as error:
        await decode_token_answer(raw, limit)
    assert error.value.status == status


def test_the_body_reads_every_sampling_field_the_router_checks():
    """Fields lists them by hand (a msgspec struct); one missing would go unchecked, silently."""
    assert set(SAMPLING_FIELDS) <= set(Fields.__struct_fields__)
