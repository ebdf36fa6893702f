"""The ``chat`` tenants of ``kvroute bench regimes``: prose conversations, tokenized as the engines do (pure)."""

from __future__ import annotations

import statistics

import pytest

from kvroute.bench.regimes_chat import CHAT_SYSTEMS, CHAT_TURNS, chat_conversations, transcript, vocabulary
from kvroute.bench.replay_workload import reference_hit_rates
from kvtokens.tokenizer import ModelPrompts
from sim_engine.block_pool import CacheKeys, chain_hashes
from sim_engine.settings import TINY_MODEL_DIR


@pytest.fixture(scope="module")
def prompts() -> ModelPrompts:
    return ModelPrompts(TINY_MODEL_DIR)


@pytest.fixture(scope="module")
def chats(prompts):
    return chat_conversations(160, seed=1, prompts=prompts)


def test_requests_are_deterministic_per_seed(prompts, chats):
    assert chat_conversations(160, seed=1, prompts=prompts) == chats
    assert chat_conversations(160, seed=2, prompts=prompts).texts != chats.texts


def test_each_request_is_hashed_as_the_engine_hashes_its_tokens(prompts, chats):
    for request, text in zip(chats.requests, chats.texts, strict=True):
        tokens = prompts.encode(text, add_special_tokens=True)
        assert request.input_length == len(tokens)
        assert list(request.hash_ids) == chain_hashes(tokens, 16, CacheKeys())


def test_a_turn_extends_the_previous_one_and_tenants_share_their_system_prompt(chats):
    turns: dict[int, int] = {}
    for i, previous in enumerate(chats.after):
        if previous is None:
            turns[i] = 1
            continue
        assert previous < i and chats.tenants[previous] == chats.tenants[i]
        turns[i] = turns[previous] + 1
        before, now = chats.requests[previous].hash_ids, chats.requests[i].hash_ids
        # the earlier prompt's text is a prefix of this one's: all its full blocks but the one
        # where its text ends (a word the tokenizer may cut differently once it goes on) are shared
        shared = next((d for d, (a, b) in enumerate(zip(before, now, strict=False)) if a != b), len(before))
        assert shared >= len(before) - 2 and len(now) > len(before)
        assert chats.texts[i].startswith(chats.texts[previous])
    assert max(turns.values()) == CHAT_TURNS and sum(1 for t in turns.values() if t == 1) == 160 // CHAT_TURNS
    roots = {}
    for i, tenant in enumerate(chats.tenants):
        roots.setdefault(tenant, chats.requests[i].hash_ids[:20])
        assert chats.requests[i].hash_ids[:20] == roots[tenant]
    assert len(roots) == CHAT_SYSTEMS and len({r for r in roots.values()}) == CHAT_SYSTEMS


def test_prompts_are_prose_of_about_two_thousand_tokens(prompts, chats):
    mean = statistics.mean(r.input_length for r in chats.requests)
    assert 1_600 <= mean <= 2_800
    words = chats.texts[0].split()
    assert 350 <= len(words) <= 620  # a ~450-word system prompt and a ~50-word question
    # pieces of words, not one token a word: block boundaries fall inside words
    assert len(prompts.encode(chats.texts[0], add_special_tokens=False)) > 2 * len(words)


def test_the_shared_lru_reference_counts_the_engines_blocks(chats):
    lru, infinite = reference_hit_rates(chats.requests, 10**9, block_tokens=16)
    assert lru == infinite > 0.5  # follow-up turns and shared system prompts
    tight, _ = reference_hit_rates(chats.requests, 200, block_tokens=16)
    assert 0 < tight < lru


def test_the_transcript_and_vocabulary(prompts):
    import random

    assert transcript("S.", [("q1", "a1")], "q2") == "S.\n\nUser: q1\nAssistant: a1\nUser: q2\nAssistant:"
    words = vocabulary(random.Random(1), prompts, size=100)
    assert len(set(words)) == 100 and all(w.isalpha() for w in words)
