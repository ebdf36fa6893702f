"""The requests ``kvroute bench replay`` sends: a Mooncake-format trace or a built-in workload,
as token ids or as text, and the offline references they are judged against.

A trace names each 512-token block by a hash id (equal ids at equal positions are equal
prefixes). Each id becomes 512 deterministic token ids or, for routers that take only text
(SGLang's), 512 deterministic words that the tiny model's tokenizer reads as exactly one token
each, so both forms share prefixes block for block.
"""

from __future__ import annotations

import json
import random
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from kvtokens.tokenizer import ModelPrompts

TRACE_BLOCK = 512
SYNTHETIC = ("shared-prefix", "multi-turn", "documents")


@dataclass(frozen=True)
class TraceRequest:
    at_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: Path, limit: int, max_input: int) -> list[TraceRequest]:
    out: list[TraceRequest] = []
    with path.open() as fh:
        for number, line in enumerate(fh, 1):
            if len(out) >= limit:
                break
            try:
                row = json.loads(line)
                hash_ids = tuple(int(h) for h in row["hash_ids"])
                lengths = int(row["input_length"]), int(row.get("output_length", 1))
                request = TraceRequest(row["timestamp"] / 1000, *lengths, hash_ids)
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: not a Mooncake trace row ({exc!r})") from None
            if request.input_length <= max_input:
                out.append(request)
    return out


def synthetic_trace(kind: str, count: int, seed: int = 11, rate: float = 4.0) -> list[TraceRequest]:
    """Built-in workloads in the trace's terms (512-token blocks as ids), Poisson arrivals at
    ``rate`` per second: SGLang-style shared-prefix groups, multi-turn chats, long documents."""
    rng = random.Random(seed)
    next_id = iter(range(1_000_000, 10**9))
    at, out = 0.0, []
    groups = [[next(next_id) for _ in range(8)] for _ in range(16)]  # 16 prefixes of 4k tokens
    documents = [[next(next_id) for _ in range(24)] for _ in range(12)]  # 12 documents of 12k tokens
    chats: list[list[int]] = [[] for _ in range(48)]
    for _ in range(count):
        at += rng.expovariate(rate)
        if kind == "shared-prefix":
            ids = [*rng.choice(groups), next(next_id)]
        elif kind == "documents":
            ids = [*rng.choice(documents), next(next_id)]
        elif kind == "multi-turn":
            chat = rng.choice(chats)
            if len(chat) > 24:
                chat.clear()  # the conversation ends; a new one starts in its slot
            chat += [next(next_id) for _ in range(rng.randint(1, 2))]
            ids = list(chat)
        else:
            raise ValueError(f"unknown synthetic workload {kind!r}; choose from {', '.join(SYNTHETIC)}")
        out.append(TraceRequest(at, len(ids) * TRACE_BLOCK - rng.randint(0, 200), 8, tuple(ids)))
    return out


def tokens_of(request: TraceRequest, cache: dict[int, list[int]]) -> list[int]:
    tokens: list[int] = []
    for hash_id in request.hash_ids:
        block = cache.get(hash_id)
        if block is None:
            rng = random.Random(hash_id)
            block = cache[hash_id] = [rng.randrange(10, 2000) for _ in range(TRACE_BLOCK)]
        tokens += block
    return tokens[: request.input_length]


class TextPrompts:
    """Trace requests as text: each block id -> 512 words of one token each (with their space)."""

    def __init__(self, prompts: ModelPrompts) -> None:
        self._words = single_token_words(prompts)
        self._blocks: dict[int, list[str]] = {}

    def text_of(self, request: TraceRequest) -> str:
        words: list[str] = []
        for hash_id in request.hash_ids:
            block = self._blocks.get(hash_id)
            if block is None:
                rng = random.Random(hash_id)
                block = self._blocks[hash_id] = [rng.choice(self._words) for _ in range(TRACE_BLOCK)]
            words += block
        # One token fewer than the trace's length: the tokenizer may add a BOS token.
        return "".join(words[: max(1, request.input_length - 1)])


def single_token_words(prompts: ModelPrompts, want: int = 256) -> list[str]:
    """Words that, with a leading space, the tokenizer reads as one token whatever precedes them."""
    words: list[str] = []
    decoded = (prompts.decode([token_id]) for token_id in range(prompts.vocab_size))
    for text in sorted({d for d in decoded if len(d) >= 4 and d[0] == " " and d[1:].isascii() and d[1:].isalpha()}):
        if len(prompts.encode(text, False)) == 1 and len(prompts.encode("x" + text, False)) == 2:
            words.append(text)
        if len(words) >= want:
            break
    if len(words) < 16:
        raise ValueError("the tokenizer has too few single-token words to build text prompts")
    return words


def reference_hit_rates(
    requests: list[TraceRequest], capacity_blocks: int, block_tokens: int = TRACE_BLOCK
) -> tuple[float, float]:
    """(shared LRU cache of ``capacity_blocks`` blocks of ``block_tokens`` tokens, infinite cache) hit rates."""
    lru: OrderedDict[int, None] = OrderedDict()
    seen: set[int] = set()
    prompt = lru_hits = infinite_hits = 0
    for request in requests:
        prompt += request.input_length
        cap = request.input_length - 1
        depth = next((i for i, h in enumerate(request.hash_ids) if h not in lru), len(request.hash_ids))
        lru_hits += min(depth * block_tokens, cap)
        depth = next((i for i, h in enumerate(request.hash_ids) if h not in seen), len(request.hash_ids))
        infinite_hits += min(depth * block_tokens, cap)
        for hash_id in request.hash_ids:
            lru[hash_id] = None
            lru.move_to_end(hash_id)
            seen.add(hash_id)
        while len(lru) > capacity_blocks:
            lru.popitem(last=False)
    return lru_hits / max(prompt, 1), infinite_hits / max(prompt, 1)
