"""Memoized block hashes for prompts that share prefixes (system prompts, multi-turn chats).

Hashing a prompt costs one XXH3 call per block for the block's tokens and one more to chain it,
a Python-level loop that is the router's largest CPU cost on long prompts (~1 us per block). Most
traffic repeats long prefixes, so the chain hashes of a prefix are kept, in segments of
``segment_blocks`` blocks, keyed by a 128-bit digest of the exact token bytes (and block size and
identity) of the whole prefix up to the segment's end. Digesting the prefix bytes runs in C at
memory speed, so a prompt only pays the Python loop for the blocks past its longest remembered
prefix. The result is always identical to :func:`kvindex.hashing.sequence_hashes`.
"""

from __future__ import annotations

import struct
from array import array
from collections import OrderedDict
from collections.abc import Sequence

import xxhash

from kvindex.hashing import chain_hashes, identity_tag, local_hashes_of_bytes, token_bytes

DEFAULT_SEGMENT_BLOCKS = 16
DEFAULT_MAX_SEGMENTS = 16_384  # ~10 MB: 262,144 blocks of distinct prefixes


class PrefixHashMemo:
    """An LRU of chain-hash segments; one per router (not thread-safe, used on the event loop)."""

    def __init__(self, segment_blocks: int = DEFAULT_SEGMENT_BLOCKS, max_segments: int = DEFAULT_MAX_SEGMENTS) -> None:
        if segment_blocks <= 0 or max_segments <= 0:
            raise ValueError("segment_blocks and max_segments must be positive")
        self._segment_blocks = segment_blocks
        self._max_segments = max_segments
        self._segments: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        self.hits = 0  # blocks whose hashes came from the memo
        self.misses = 0  # blocks hashed

    def __len__(self) -> int:
        return len(self._segments)

    def sequence_hashes(
        self,
        tokens: Sequence[int] | array,
        block_size: int,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> list[int]:
        """Same result as :func:`kvindex.hashing.sequence_hashes`, reusing remembered prefixes."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        data = token_bytes(tokens)
        identity = identity_tag(lora_name, cache_salt)
        segment_bytes = 4 * block_size * self._segment_blocks
        full_segments = len(data) // (4 * block_size) // self._segment_blocks
        # The digest of the prefix up to each segment's end, from one streaming pass.
        prefix = xxhash.xxh3_128(struct.pack("<I", block_size) + (identity or b"\x00"))
        keys: list[int] = []
        for i in range(full_segments):
            prefix.update(data[i * segment_bytes : (i + 1) * segment_bytes])
            keys.append(prefix.intdigest())
        chain: list[int] = []
        for key in keys:
            segment = self._segments.get(key)
            if segment is None:
                break
            self._segments.move_to_end(key)
            chain.extend(segment)
        remembered = len(chain)
        rest = local_hashes_of_bytes(data[remembered * 4 * block_size :], block_size)
        chain.extend(chain_hashes(rest, identity if not chain else None, chain[-1] if chain else None))
        self.hits += remembered
        self.misses += len(rest)
        self._remember(keys[remembered // self._segment_blocks :], chain, remembered)
        return chain

    def _remember(self, keys: list[int], chain: list[int], start_block: int) -> None:
        step = self._segment_blocks
        for n, key in enumerate(keys):
            begin = start_block + n * step
            self._segments[key] = tuple(chain[begin : begin + step])
        while len(self._segments) > self._max_segments:
            self._segments.popitem(last=False)
