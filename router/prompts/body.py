"""A request body, decoded only as far as the router reads it, without stalling the event loop.

The router forwards the body's bytes as they are; it reads only a few fields (the model, the
prompt or messages, the salt, the stream flag). Those are decoded into :class:`Fields`, every
other field is skipped by the C parser without building objects, and the prompt is kept raw
until it is looked at. A long token-id prompt is the costly part (a 9.6 MB body of 1.4M ids
took msgspec ~120 ms, in one C call that holds the GIL, so a thread would not help): it is
decoded in slices of ``SLICE_BYTES`` (~5 ms each) that yield to the event loop in between,
straight into a u32 array, after its length was checked against the prompt limit by counting
commas. A batch of prompts is routed by its first one, so only that one is decoded.
"""

from __future__ import annotations

import asyncio
import re
from array import array
from typing import Any

import msgspec

from router.prompts.id_memo import TokenIdMemo

SLICE_BYTES = 256 * 1024  # ~40k token ids
MEMO_MAX_BYTES = 1 << 20  # longer id prompts bypass the TokenIdMemo: they would evict most of it
TOO_DEEP = "the request body is nested too deeply"


class BodyError(ValueError):
    """The body cannot be read (400; ``status`` 413 for a prompt over the limit)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class Fields(msgspec.Struct):
    """The fields the router reads; absent ones stay UNSET (so ``"messages" in body`` keeps its sense)."""

    model: Any = msgspec.UNSET
    prompt: msgspec.Raw = msgspec.Raw()
    messages: Any = msgspec.UNSET
    cache_salt: Any = msgspec.UNSET
    stream: Any = msgspec.UNSET
    add_special_tokens: Any = msgspec.UNSET
    add_generation_prompt: Any = msgspec.UNSET
    # the sampling fields (kvtokens.sampling), checked before a request is routed
    n: Any = msgspec.UNSET
    best_of: Any = msgspec.UNSET
    max_tokens: Any = msgspec.UNSET
    max_completion_tokens: Any = msgspec.UNSET
    min_tokens: Any = msgspec.UNSET
    temperature: Any = msgspec.UNSET
    top_p: Any = msgspec.UNSET
    top_k: Any = msgspec.UNSET
    min_p: Any = msgspec.UNSET
    presence_penalty: Any = msgspec.UNSET
    frequency_penalty: Any = msgspec.UNSET
    repetition_penalty: Any = msgspec.UNSET
    seed: Any = msgspec.UNSET
    stop: Any = msgspec.UNSET


class TokenizeAnswer(msgspec.Struct):
    """A worker's ``/tokenize`` answer, as far as the router reads it."""

    tokens: msgspec.Raw = msgspec.Raw()


_FIELDS = msgspec.json.Decoder(Fields)
_TOKENIZED = msgspec.json.Decoder(TokenizeAnswer)
_IDS = msgspec.json.Decoder(list[int])
_ITEMS = msgspec.json.Decoder(list[msgspec.Raw])
_ANY = msgspec.json.Decoder()


async def parse_body(raw: bytes, max_prompt_tokens: int, memo: TokenIdMemo | None = None) -> dict[str, Any]:
    """The fields as a dict (absent ones left out); the prompt decoded, a long token-id prompt
    as an ``array('I')`` (through ``memo`` where given). Raises :class:`BodyError` with a one-line
    message."""
    try:
        fields = _FIELDS.decode(raw)
    except msgspec.ValidationError:  # every field takes any value: only the top level can mismatch
        raise BodyError("the request body must be a JSON object") from None
    except msgspec.DecodeError as exc:
        raise BodyError(not_json(exc, raw)) from None
    except RecursionError:
        raise BodyError(TOO_DEEP) from None
    body = {f: getattr(fields, f) for f in Fields.__struct_fields__ if f != "prompt"}
    body = {name: value for name, value in body.items() if value is not msgspec.UNSET}
    prompt = bytes(fields.prompt)
    if prompt:
        body["prompt"] = await decode_prompt(prompt, max_prompt_tokens, memo)
    return body


async def decode_token_answer(raw: bytes, max_prompt_tokens: int) -> array:
    """The token ids of a ``/tokenize`` answer, a long list in slices (as :func:`decode_prompt`);
    :class:`BodyError` when it has none or too many."""
    try:
        answer = _TOKENIZED.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        raise BodyError("the answer is not a JSON object") from None
    tokens = await decode_prompt(bytes(answer.tokens), max_prompt_tokens)
    if isinstance(tokens, array):
        return tokens
    if not isinstance(tokens, list):
        raise BodyError("the answer has no 'tokens' array")
    if len(tokens) > max_prompt_tokens:
        raise BodyError(too_long(len(tokens), max_prompt_tokens), 413)
    try:
        return array("I", tokens)
    except (TypeError, OverflowError):
        raise BodyError("token ids must be integers in 0..4294967295") from None


def too_long(tokens: int, limit: int) -> str:
    return f"the prompt has {tokens} tokens; this router accepts at most {limit} (--max-prompt-tokens)"


async def decode_prompt(raw: bytes, max_prompt_tokens: int, memo: TokenIdMemo | None = None) -> Any:
    """``raw`` decoded; a long flat array of numbers in slices, into an ``array('I')``; of a
    long batch only its first prompt (the one that routes it). Through ``memo`` (an array of ids
    longer than two of its chunks, up to MEMO_MAX_BYTES): decoded only past the text it remembers,
    into an ``array('I')``."""
    raw = raw.strip()
    if not raw.startswith(b"["):
        return _decode(_ANY, raw)
    remembering = memo is not None and 2 * memo.chunk_bytes < len(raw) <= MEMO_MAX_BYTES
    if len(raw) <= SLICE_BYTES:
        return _through_memo(raw, memo) if memo is not None and remembering else _decode(_ANY, raw)
    if raw.find(b"[", 1) != -1:  # a batch: its first prompt routes it
        items = _decode(_ITEMS, raw)
        return [await decode_prompt(bytes(items[0]), max_prompt_tokens, memo)] if items else []
    if raw.find(b'"') != -1 or raw.find(b"{") != -1:  # strings or objects: not token ids
        return _decode(_ANY, raw)
    tokens = raw.count(b",") + 1
    if tokens > max_prompt_tokens:
        raise BodyError(too_long(tokens, max_prompt_tokens), 413)
    if memo is not None and remembering:
        return await _long_through_memo(raw, memo)
    return await _token_ids(raw)


def _through_memo(raw: bytes, memo: TokenIdMemo) -> Any:
    """An array starting ``[``: as an ``array('I')`` decoded past what ``memo`` remembers when it
    is all u32 ids (JSON integers, as :func:`_token_ids` reads them), else as the ordinary
    decoding gives it (a batch, strings, other values). A remembered prefix is such ids (its
    text was), so the whole is exactly when the rest after the prefix's last cut, put in
    brackets, decodes to them."""
    cuts = memo.cuts(raw)
    ids, known, keys = memo.known_prefix(raw, cuts)
    known_ids = len(ids)
    try:
        ids.extend(array("I", _IDS.decode(b"[" + raw[cuts[known - 1] + 1 :] if known else raw)))
    except (msgspec.DecodeError, RecursionError, OverflowError):  # ValidationError is a DecodeError
        return _decode(_ANY, raw)
    memo.remember(raw, cuts, keys, ids, known, known_ids)
    return ids


async def _long_through_memo(raw: bytes, memo: TokenIdMemo) -> array:
    """:func:`_token_ids` of ``raw`` (checked to be a flat array of numbers), decoded past what
    ``memo`` remembers."""
    cuts = memo.cuts(raw)
    ids, known, keys = memo.known_prefix(raw, cuts)
    known_ids = len(ids)
    ids.extend(await _token_ids(b"[" + raw[cuts[known - 1] + 1 :] if known else raw))
    memo.remember(raw, cuts, keys, ids, known, known_ids)
    return ids


async def _token_ids(raw: bytes) -> array:
    ids = array("I")
    start, end = 1, raw.rindex(b"]")
    while start < end:
        cut = raw.find(b",", start + SLICE_BYTES, end)
        stop = end if cut == -1 else cut
        try:
            ids.extend(array("I", _decode(_IDS, b"[" + raw[start:stop] + b"]")))
        except (BodyError, OverflowError):
            raise BodyError("token ids must be integers in 0..4294967295") from None
        start = stop + 1
        await asyncio.sleep(0)  # let the loop answer others between slices
    return ids


def _decode(decoder: msgspec.json.Decoder[Any], raw: bytes) -> Any:
    try:
        return decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BodyError(not_json(exc, raw)) from None
    except RecursionError:
        raise BodyError(TOO_DEEP) from None


# \uD800-\uDBFF not followed by \uDC00-\uDFFF, or \uDC00-\uDFFF not after one: half a character
_LONE_SURROGATE = re.compile(
    rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
    rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}"
)


def not_json(exc: Exception, raw: bytes) -> str:
    """The one-line error for a body msgspec could not decode. A lone surrogate escape gets its
    own words: msgspec's ("Input data was truncated", "unexpected end of hex escape") mislead."""
    lone = _LONE_SURROGATE.search(raw)
    if lone is not None:
        escape = lone.group().decode()
        return f"the request body is not valid JSON: {escape} is half of a UTF-16 surrogate pair, not a character"
    return f"the request body is not valid JSON: {exc}"
