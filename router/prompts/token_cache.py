"""Token ids that workers' ``/tokenize`` returned, kept by total size (not by count).

An entry is the prompt's ids as u32 (4 bytes a token, where a list of Python ints took ~36);
the cache holds at most ``max_tokens`` of them in all, least recently used out first, and an
answer larger than a quarter of that is not kept (one huge prompt would flush every other).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict

DEFAULT_MAX_TOKENS = 1 << 22  # 16 MiB of u32 ids


class TokenCache:
    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self.tokens = 0  # held now, in all
        self._entries: OrderedDict[str, array] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> array | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key: str, ids: array) -> None:
        if len(ids) > self.max_tokens // 4:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.tokens -= len(old)
        self._entries[key] = ids
        self.tokens += len(ids)
        while self.tokens > self.max_tokens:
            _, evicted = self._entries.popitem(last=False)
            self.tokens -= len(evicted)
