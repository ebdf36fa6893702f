"""Memoized tokenization equals a full tokenization exactly: vLLM's /tokenize captures (golden),
random texts against the tokenizer itself, multi-turn growth; tokenizers it cannot cut get no memo."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from kvtokens.tokenizer import ModelPrompts
from router.prompts.token_memo import TokenMemo
from router.prompts.tokenization import OFF_LOOP_CHARS, Tokenization
from sim_engine.settings import TINY_MODEL_DIR
from tests.unit.test_prompts import CHAT, TEXT1, captured

# Characters that stress the cuts: whitespace of every kind, contractions, punctuation, digits,
# multi-byte text, the model's added tokens and pieces of them.
ALPHABET = [
    *"ab cd  \n\t'sxyz.,!?0123 ",
    *("'s", "'ll", "  ", "\n\n", "\r\n", "\r", "é", "日本", "\u00a0", "\u3000", "\u2003", "\u2028", "\x85", "\x0b"),
    *("\x1c", "\u200b", "\u180e", " '", "''", "<|im_start|>", "<|im_end|>", "<s>", "</s>", "<unk>", "<|im", "_end|>"),
]


@pytest.fixture(scope="module")
def prompts() -> ModelPrompts:
    return ModelPrompts(TINY_MODEL_DIR)


def memo_of(prompts: ModelPrompts, **kwargs) -> TokenMemo:
    memo = TokenMemo.for_tokenizer(prompts.tokenizer, **kwargs)
    assert memo is not None
    return memo


def test_text_and_chat_tokenize_as_the_captured_vllm_did(prompts):
    memo = memo_of(prompts, chunk_chars=16)
    for _ in range(2):  # cold, then every piece remembered
        assert list(memo.encode(TEXT1)) == captured("tokenize_prompt")
        assert list(memo.encode(TEXT1, add_special_tokens=False)) == captured("tokenize_prompt_nospecial")
        assert list(memo.encode(prompts.render_chat(CHAT), False)) == captured("tokenize_chat")
    assert memo.hits > 0


@pytest.mark.parametrize("chunk_chars", [1, 5, 64])
def test_random_texts_equal_a_full_tokenization(prompts, chunk_chars):
    memo = memo_of(prompts, chunk_chars=chunk_chars)
    rng = random.Random(chunk_chars)
    for _ in range(3000):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randrange(0, 80)))
        for special in (True, False):
            assert list(memo.encode(text, special)) == prompts.encode(text, special), repr(text)


def test_growing_conversations_tokenize_only_their_new_end(prompts):
    memo = memo_of(prompts, chunk_chars=32)
    rng = random.Random(7)
    words = ["cache", "block", "router", " prefix", "token's", "engine,", "\n", "  ", "worker.", "日本"]
    messages = [{"role": "system", "content": " ".join(rng.choice(words) for _ in range(300))}]
    for turn in range(8):
        messages.append({"role": "user", "content": " ".join(rng.choice(words) for _ in range(40 + turn))})
        text = prompts.render_chat(messages)
        new = sum(len(piece) for piece in memo.missing(memo.pieces(text)))
        assert list(memo.encode(text, False)) == prompts.chat_tokens(messages)
        if turn:  # the last two messages and the template's words around them, not the rest
            assert new <= len(messages[-1]["content"]) + len(messages[-2]["content"]) + 40
        messages.append({"role": "assistant", "content": " ".join(rng.choice(words) for _ in range(20))})
    completion = ""
    for _ in range(6):  # a completion's text growing turn by turn
        completion += " ".join(rng.choice(words) for _ in range(60))
        assert list(memo.encode(completion)) == prompts.encode(completion)


def test_the_memo_is_bounded_by_tokens(prompts):
    memo = memo_of(prompts, max_tokens=400, chunk_chars=8)
    for i in range(200):
        text = f"entry number {i} with a few more words in it"
        assert list(memo.encode(text)) == prompts.encode(text)
        assert memo.tokens <= 400
    assert memo.tokens == sum(len(ids) for ids in memo._pieces.values()) // 4


def _tokenizer(pre_tokenizer: pre_tokenizers.PreTokenizer, added: AddedToken | None = None) -> Tokenizer:
    vocab = {"a": 0, "b": 1, " ": 2, "▁": 3, "[SEP]": 4}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    tokenizer.pre_tokenizer = pre_tokenizer
    if added is not None:
        tokenizer.add_special_tokens([added])
    return tokenizer


def test_tokenizers_that_cannot_be_cut_exactly_get_no_memo():
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    assert TokenMemo.for_tokenizer(_tokenizer(byte_level, AddedToken("[SEP]", special=True))) is not None
    # Metaspace prepends its marker to the first stretch only: where a stretch sits matters.
    assert TokenMemo.for_tokenizer(_tokenizer(pre_tokenizers.Metaspace(prepend_scheme="first"))) is None
    # An added token that swallows the whitespace around it is not matched on the raw text alone.
    assert TokenMemo.for_tokenizer(_tokenizer(byte_level, AddedToken("[SEP]", lstrip=True, special=True))) is None
    spec = json.loads(_tokenizer(byte_level).to_str())
    spec["truncation"] = {"max_length": 4, "strategy": "LongestFirst", "stride": 0, "direction": "Right"}
    assert TokenMemo.for_tokenizer(Tokenizer.from_str(json.dumps(spec))) is None


def test_the_router_tokenizes_through_the_memo(prompts):
    async def scenario() -> None:
        tokenization = Tokenization({"tiny": TINY_MODEL_DIR}, upstream=None)
        assert tokenization.memos["tiny"] is not None
        long_text = TEXT1 * 30  # past OFF_LOOP_CHARS: tokenized in a thread
        for _ in range(2):
            body = {"model": "tiny", "messages": CHAT}
            assert list(await tokenization.chat("tiny", body, "")) == captured("tokenize_chat")
            assert list(await tokenization.completion("tiny", {"prompt": TEXT1}, "")) == captured("tokenize_prompt")
            got = await tokenization.completion("tiny", {"prompt": long_text, "add_special_tokens": False}, "")
            assert list(got) == prompts.encode(long_text, add_special_tokens=False)

    asyncio.run(scenario())


def test_new_text_of_known_words_needs_no_tokenizer(prompts):
    memo = memo_of(prompts, chunk_chars=32)
    rng = random.Random(3)
    words = ["cache", "block's", "router,", "prefix", "  token", "\nengine", "日本", "worker."]
    first = " ".join(rng.choice(words) for _ in range(400))
    assert list(memo.encode(first)) == prompts.encode(first)
    for _ in range(20):  # the same words in another order: every new piece is made of known words
        text = " ".join(rng.choice(words) for _ in range(100))
        pieces = memo.pieces(text)
        new_words = memo.missing(pieces)
        assert list(memo.assemble(pieces, True, {w: prompts.encode(w, False) for w in new_words})) == prompts.encode(
            text
        )
    assert len(new_words) <= 2  # at most a piece's first word, cut differently (no space before it)


def test_much_new_text_is_put_together_in_slices_and_remembered(prompts):
    """Past OFF_LOOP_CHARS of new text, the router puts the new pieces together a slice at a
    time, the event loop free between slices: the same ids, and every piece remembered."""

    async def scenario() -> None:
        tokenization = Tokenization({"tiny": TINY_MODEL_DIR}, upstream=None)
        memo = tokenization.memos["tiny"]
        assert memo is not None
        rng = random.Random(11)
        words = ["cache", "block's", "router,", "prefix", "  token", "\nengine", "日本", "worker."]
        known = " ".join(rng.choice(words) for _ in range(200))
        await tokenization.completion("tiny", {"prompt": known}, "")  # every word known from here on
        text = " ".join(rng.choice(words) for _ in range(3000))  # new pieces, of known words
        assert len(text) > OFF_LOOP_CHARS
        tokenizing = asyncio.create_task(tokenization.completion("tiny", {"prompt": text}, ""))

        async def another_request() -> bool:  # runs at the first slice's end
            return tokenizing.done()

        assert await asyncio.create_task(another_request()) is False  # it did not wait for the whole text
        assert list(await tokenizing) == prompts.encode(text)
        assert memo.new_pieces(memo.pieces(text)) == []  # the pieces themselves are remembered

    asyncio.run(scenario())
