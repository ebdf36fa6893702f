"""Tokenization identical to the real vLLM server's (golden: its /tokenize captures in tests/fixtures)."""

from __future__ import annotations

import json
import re

import pytest

from kvtokens.tokenizer import ModelPrompts, PromptError
from sim_engine.settings import TINY_MODEL_DIR
from tests.conftest import CAPTURES

TEXT1 = ("The quick brown fox jumps over the lazy dog. " * 8).strip()
CHAT = [
    {"role": "system", "content": "You are a tiny test model."},
    {"role": "user", "content": "Hello world, tell me about the cache block router please."},
]


def captured(name: str) -> list[int]:
    text = (CAPTURES / "run1_tokenize_and_http.txt").read_text()
    match = re.search(rf"### POST /tokenize \({name}\)\nrequest: .*\nresponse: (.*)\n", text)
    assert match, name
    return json.loads(match.group(1))["tokens"]


@pytest.fixture(scope="module")
def prompts() -> ModelPrompts:
    """The tokenizer bundled with the simulated engine: the files the real vLLM server loaded."""
    return ModelPrompts(TINY_MODEL_DIR)


def test_text_prompts_tokenize_as_vllm_does(prompts):
    assert prompts.encode(TEXT1) == captured("tokenize_prompt")
    assert prompts.encode(TEXT1, add_special_tokens=False) == captured("tokenize_prompt_nospecial")


def test_chats_render_and_tokenize_as_vllm_does(prompts):
    assert prompts.chat_tokens(CHAT, add_generation_prompt=True) == captured("tokenize_chat")
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    assert prompts.chat_tokens(parts) == prompts.chat_tokens([{"role": "user", "content": "Hello\nthere"}])


def test_the_captured_completion_text_decodes_the_same(prompts):
    http = json.loads((CAPTURES / "run1_http.json").read_text())["A_tokens_70"]["response"]["body"]
    choice = http["choices"][0]
    assert prompts.decode(choice["token_ids"]) == choice["text"]


@pytest.mark.parametrize(
    ("messages", "message"),
    [([], "non-empty array"), ([{"content": "x"}], "string 'role'"), ([{"role": "user", "content": 5}], "content")],
)
def test_bad_chats_are_rejected_with_a_reason(prompts, messages, message):
    with pytest.raises(PromptError, match=message):
        prompts.chat_tokens(messages)
