"""The requests of ``kvroute bench real``: multi-turn conversations sized for a real vLLM on the CPU (pure).

Every workload is ``SYSTEMS`` system prompts (tenants) x ``CONVERSATIONS`` conversations each x
``TURNS`` turns, the conversations started in an order shuffled per seed. A request is its
tenant's system prompt, the conversation so far (user turns and the client's scripted answers)
and a new user turn; the engine's own replies are not fed back (they are noise from random
weights), so every run of a seed sends the same prompts. Three forms, each what a client sends:

* ``ids``: token ids to ``/v1/completions``: system prompts of ~640 tokens, user turns of 40-100
  tokens, answers of 20-60 (a request is ~680-1,100 tokens);
* ``text``: prose (pseudo-words glued from the tokenizer's own pieces, :mod:`kvroute.bench.regimes_chat`)
  as a completion prompt, tokenized by the router (~480-1,000 tokens);
* ``chat``: the same prose as messages to ``/v1/chat/completions`` (the model's chat template).

Each request carries the chain hashes of its prompt's blocks as the engine computes them
(``hash_ids``), so the shared-LRU reference counts exactly the blocks the engines cache.

Arrival order (what an open-loop client replays): ``OPEN`` conversations are open at once and each
arrival goes to one of them at random (a turn is sent after the previous turn's answer); a
closed-loop client instead plays one conversation at a time (:attr:`RealWorkload.conversations`,
in the order they start).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from kvroute.bench.regimes_chat import sentence_text, transcript, vocabulary
from kvroute.bench.replay_workload import TraceRequest
from kvtokens.tokenizer import ModelPrompts
from sim_engine.block_pool import CacheKeys, chain_hashes

WORKLOADS = ("ids", "text", "chat")
SYSTEMS = 8
CONVERSATIONS = 4  # per system prompt
TURNS = 4
OPEN = 4  # conversations open at once in the arrival order
OUTPUT_TOKENS = 8
SYSTEM_TOKENS = (560, 720)  # ids: a system prompt's length, uniform
USER_TOKENS = (40, 100)
ANSWER_TOKENS = (20, 60)
SYSTEM_WORDS, USER_WORDS, ANSWER_WORDS = 160, 25, 15  # text and chat: ~3 tokens a word
FIRST_ID, LAST_ID = 10, 2000  # token ids drawn for ids prompts (below: the tiny model's special tokens)


@dataclass(frozen=True)
class RealWorkload:
    """A seed's requests in arrival order."""

    kind: str
    requests: list[TraceRequest]  # prompt length and block chain hashes (at_s: 0, set by the client)
    prompts: list[Any]  # what is sent: token ids, a text prompt, or chat messages
    after: list[int | None]  # each request's previous turn (None: a first turn)
    tenants: list[int]
    conversations: list[list[int]]  # each conversation's requests in turn order, in the order they start

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.kind == "chat" else "/v1/completions"

    def body(self, index: int, max_tokens: int) -> dict[str, Any]:
        """Request ``index``'s body (the model and streaming are the client's to add)."""
        key = "messages" if self.kind == "chat" else "prompt"
        return {key: self.prompts[index], "max_tokens": max_tokens}

    @property
    def mean_prompt_tokens(self) -> float:
        return sum(r.input_length for r in self.requests) / max(len(self.requests), 1)

    @property
    def distinct_blocks(self) -> int:
        return len({h for r in self.requests for h in r.hash_ids})


@dataclass
class _Chat:
    tenant: int
    turns: list[tuple[Any, Any]]  # (user, answer) so far
    requests: list[int]


def real_workload(kind: str, seed: int, prompts: ModelPrompts, block_size: int) -> RealWorkload:
    """The ``kind`` workload of ``seed`` (deterministic), hashed in ``block_size``-token blocks."""
    if kind not in WORKLOADS:
        raise ValueError(f"unknown workload {kind!r}: choose from {', '.join(WORKLOADS)}")
    rng = random.Random(f"real/{kind}/{seed}")
    write = _TokenWriter(rng) if kind == "ids" else _ProseWriter(rng, prompts)
    systems = [write.system() for _ in range(SYSTEMS)]
    queue = [t for t in range(SYSTEMS) for _ in range(CONVERSATIONS)]
    rng.shuffle(queue)
    out = RealWorkload(kind, [], [], [], [], [])
    slots: list[_Chat | None] = [None] * OPEN
    while queue or any(slots):
        slot = rng.randrange(OPEN)
        chat = slots[slot]
        if chat is None:
            if not queue:
                continue
            chat = slots[slot] = _Chat(queue.pop(0), [], [])
            out.conversations.append(chat.requests)
        question = write.user()
        prompt = _prompt(kind, systems[chat.tenant], chat.turns, question)
        tokens = _tokens(kind, prompt, prompts)
        hashes = tuple(chain_hashes(tokens, block_size, CacheKeys()))
        out.after.append(chat.requests[-1] if chat.requests else None)
        chat.requests.append(len(out.requests))
        out.requests.append(TraceRequest(0.0, len(tokens), OUTPUT_TOKENS, hashes))
        out.prompts.append(prompt)
        out.tenants.append(chat.tenant)
        chat.turns.append((question, write.answer()))
        if len(chat.turns) == TURNS:
            slots[slot] = None
    return out


def _prompt(kind: str, system: Any, turns: list[tuple[Any, Any]], question: Any) -> Any:
    if kind == "ids":
        return [*system, *(t for user, answer in turns for t in (*user, *answer)), *question]
    if kind == "text":
        return transcript(system, turns, question)
    messages = [{"role": "system", "content": system}]
    for user, answer in turns:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    return [*messages, {"role": "user", "content": question}]


def _tokens(kind: str, prompt: Any, prompts: ModelPrompts) -> list[int]:
    """The prompt's token ids as the engine computes them."""
    if kind == "ids":
        return list(prompt)
    if kind == "text":
        return prompts.encode(prompt, add_special_tokens=True)
    return prompts.chat_tokens(prompt)


class _TokenWriter:
    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def _ids(self, bounds: tuple[int, int]) -> list[int]:
        return [self._rng.randrange(FIRST_ID, LAST_ID) for _ in range(self._rng.randint(*bounds))]

    def system(self) -> list[int]:
        return self._ids(SYSTEM_TOKENS)

    def user(self) -> list[int]:
        return self._ids(USER_TOKENS)

    def answer(self) -> list[int]:
        return self._ids(ANSWER_TOKENS)


class _ProseWriter:
    def __init__(self, rng: random.Random, prompts: ModelPrompts) -> None:
        self._rng = rng
        self._words = vocabulary(rng, prompts)

    def system(self) -> str:
        return sentence_text(self._rng, self._words, SYSTEM_WORDS)

    def user(self) -> str:
        return sentence_text(self._rng, self._words, USER_WORDS)

    def answer(self) -> str:
        return sentence_text(self._rng, self._words, ANSWER_WORDS)
