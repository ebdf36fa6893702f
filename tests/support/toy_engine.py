"""A toy engine for property tests: a content-addressed block cache with copies and its own hash
function (as vLLM has), emitting vLLM-shaped event maps (``sim_engine.kv_events``)."""

from __future__ import annotations

import hashlib
from typing import Any

from hypothesis import strategies as st

from sim_engine.kv_events import cleared_event, removed_event, stored_event

BS = 4

# Prompts share prefixes: two "documents" of 4 blocks; prompt = doc blocks [0, n). Few blocks,
# so that random steps often hit the same block (duplicates, repeated evictions).
DOCS = [[(d * 7 + i * 3 + j) % 50 for i in range(4) for j in range(BS)] for d in range(2)]
SALTS = [None, "tenant-a"]


def engine_hash(tokens: tuple[int, ...], salt: str | None) -> int:
    """The engine's own hash of a prefix: unrelated to ours, like vLLM's sha256 truncated."""
    digest = hashlib.sha256(repr((salt, tokens)).encode()).digest()
    return int.from_bytes(digest[:8], "little")


class ToyEngine:
    def __init__(self) -> None:
        self.copies: dict[int, int] = {}  # engine hash -> copies
        self.content: dict[int, tuple[tuple[int, ...], str | None]] = {}

    def chain(self, doc: int, salt: str | None) -> list[int]:
        tokens = tuple(DOCS[doc])
        return [engine_hash(tokens[: (i + 1) * BS], salt) for i in range(len(tokens) // BS)]

    def store(self, doc: int, salt: str | None, n: int, duplicate_last: bool) -> list[dict[str, Any]]:
        chain = self.chain(doc, salt)[:n]
        first = next((i for i, h in enumerate(chain) if h not in self.copies), len(chain))
        if duplicate_last and first == len(chain):
            first = len(chain) - 1  # vLLM recomputes a fully cached prompt's last block
        if first >= len(chain):
            return []
        hashes = chain[first:]
        for h in hashes:
            self.copies[h] = self.copies.get(h, 0) + 1
        tokens = tuple(DOCS[doc][first * BS : len(chain) * BS])
        extra = [[salt] if salt and first == 0 and i == 0 else None for i in range(len(hashes))]
        parent = chain[first - 1] if first else None
        return [stored_event(hashes, parent, tokens, BS, extra_keys=extra)]

    def evict(self, pick: int) -> list[dict[str, Any]]:
        if not self.copies:
            return []
        victim = sorted(self.copies)[pick % len(self.copies)]
        self.copies[victim] -= 1
        if not self.copies[victim]:
            del self.copies[victim]
        return [removed_event([victim])]

    def clear(self) -> list[dict[str, Any]]:
        self.copies.clear()
        return [cleared_event()]

    def served_prefix(self, doc: int, salt: str | None) -> int:
        n = 0
        for h in self.chain(doc, salt):
            if h not in self.copies:
                break
            n += 1
        return n


# (kind, doc or eviction pick, salt, blocks, duplicate the last block)
STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("store"), st.integers(0, 1), st.sampled_from(SALTS), st.integers(1, 4), st.booleans()),
        st.tuples(st.just("evict"), st.integers(0, 1000), st.none(), st.just(0), st.just(False)),
        st.tuples(st.just("evict"), st.integers(0, 1000), st.none(), st.just(0), st.just(False)),
        st.tuples(st.just("clear"), st.just(0), st.none(), st.just(0), st.just(False)),
    ),
    max_size=40,
)


def engine_step(engine: ToyEngine, step: tuple) -> list[dict[str, Any]]:
    kind, doc, salt, n, dup = step
    if kind == "store":
        return engine.store(doc, salt, n, dup)
    if kind == "evict":
        return engine.evict(doc)
    return engine.clear()
