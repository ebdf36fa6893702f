"""The ``chat`` tenants of ``kvroute bench regimes``: conversations written as text (pure).

The other tenants values are built from 512-token blocks named by ids, so their text prompts are
one word per token, every block boundary where a word ends. Most clients send prose, which a
tokenizer cuts into pieces of varying length, and the turns of a conversation are short beside
its system prompt. This workload is that:

* 8 system prompts of about 450 words (one per tenant, used equally);
* conversations of 4 turns: a user turn of about 50 words and a scripted answer of about 25
  words each (the answer is the client's history, not the engine's output), so each request is
  the system prompt, the earlier turns and answers, and a new user turn, ~2,000 tokens with the
  tiny model's tokenizer at the last turn;
* ``count // 4`` conversations, their system prompts in turn; ``CHAT_OPEN`` of them open at once,
  each arrival going to one of them at random (a turn waits for the previous turn's reply, as in
  every cell); a finished conversation's slot starts the next one.

Words are pseudo-words drawn from a vocabulary fixed per seed, glued from the tokenizer's own
pieces; the tiny model's byte-level BPE cuts them into ~3 tokens each, so a request is ~1,500
tokens at its first turn and ~2,200 at its last. Requests are returned in the trace's terms
(:class:`TraceRequest`) with ``hash_ids`` the chain hashes of the prompt's ``block_size``-token
blocks, so that the shared-LRU reference counts exactly the blocks the engines cache.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvroute.bench.replay_workload import TraceRequest
from kvtokens.tokenizer import ModelPrompts
from sim_engine.block_pool import CacheKeys, chain_hashes

CHAT_SYSTEMS = 8
CHAT_TURNS = 4
CHAT_OPEN = 8  # conversations open at once
SYSTEM_WORDS, USER_WORDS, ANSWER_WORDS = 450, 50, 25
WORD_SPREAD = 0.2  # each text's word count is uniform within +-20% of its size
VOCABULARY = 3000
TAIL_PIECES = (1, 2, 2, 3)  # pieces glued after a word's first
OUTPUT_TOKENS = 8


@dataclass(frozen=True)
class ChatRequests:
    """The requests (no times yet), each one's previous turn, its tenant, and its prompt as text."""

    requests: list[TraceRequest]
    after: list[int | None]
    tenants: list[int]
    texts: list[str]


def vocabulary(rng: random.Random, prompts: ModelPrompts, size: int = VOCABULARY) -> list[str]:
    """Pseudo-words glued from the tokenizer's own alphabetic pieces: a word-initial piece and
    1-3 more, which the tokenizer cuts again as it likes (2-4 tokens a word, ~3 on average)."""
    pieces = [prompts.decode([token_id]) for token_id in range(prompts.vocab_size)]
    heads = sorted({p[1:] for p in pieces if len(p) >= 3 and p[0] == " " and p[1:].isascii() and p[1:].isalpha()})
    tails = sorted({p for p in pieces if len(p) >= 2 and p.isascii() and p.isalpha() and p.islower()})
    if len(heads) < 16 or len(tails) < 16:
        raise ValueError("the tokenizer has too few alphabetic pieces to write the chat workload's words")
    words: set[str] = set()
    while len(words) < size:
        words.add(rng.choice(heads) + "".join(rng.choice(tails) for _ in range(rng.choice(TAIL_PIECES))))
    return sorted(words)


def sentence_text(rng: random.Random, words: list[str], size: int) -> str:
    """About ``size`` words (within WORD_SPREAD) in sentences of 6-16 words."""
    count = rng.randint(int(size * (1 - WORD_SPREAD)), int(size * (1 + WORD_SPREAD)))
    out: list[str] = []
    while len(out) < count:
        sentence = [rng.choice(words) for _ in range(min(rng.randint(6, 16), count - len(out)))]
        sentence[0] = sentence[0].capitalize()
        sentence[-1] += "."
        out += sentence
    return " ".join(out)


def transcript(system: str, turns: list[tuple[str, str]], question: str) -> str:
    """A completion prompt: the system prompt, the turns so far, the new question."""
    history = "".join(f"\nUser: {user}\nAssistant: {answer}" for user, answer in turns)
    return f"{system}\n{history}\nUser: {question}\nAssistant:"


def chat_conversations(count: int, seed: int, prompts: ModelPrompts, block_size: int = 16) -> ChatRequests:
    rng = random.Random(f"regimes/chat/{seed}")
    words = vocabulary(rng, prompts)
    systems = [sentence_text(rng, words, SYSTEM_WORDS) for _ in range(CHAT_SYSTEMS)]
    pending = [c % CHAT_SYSTEMS for c in range(max(1, count // CHAT_TURNS))]  # tenants of the conversations
    slots: list[dict | None] = [None] * CHAT_OPEN
    out = ChatRequests([], [], [], [])
    while len(out.requests) < count and (pending or any(slots)):
        slot = rng.randrange(CHAT_OPEN)
        chat = slots[slot]
        if chat is None or len(chat["turns"]) == CHAT_TURNS:
            if not pending:
                slots[slot] = None
                continue
            chat = slots[slot] = {"tenant": pending.pop(0), "turns": [], "last": None}
        question = sentence_text(rng, words, USER_WORDS)
        text = transcript(systems[chat["tenant"]], chat["turns"], question)
        tokens = prompts.encode(text, add_special_tokens=True)
        hashes = tuple(chain_hashes(tokens, block_size, CacheKeys()))
        out.requests.append(TraceRequest(0.0, len(tokens), OUTPUT_TOKENS, hashes))
        out.after.append(chat["last"])
        out.tenants.append(chat["tenant"])
        out.texts.append(text)
        chat["turns"].append((question, sentence_text(rng, words, ANSWER_WORDS)))
        chat["last"] = len(out.requests) - 1
    return out
