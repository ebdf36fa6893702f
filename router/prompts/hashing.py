"""A prompt's block hashes without stalling the event loop: long prompts in bounded slices.

Hashing costs ~1 us per block in a Python loop (``kvindex.hashing``), so a 1.4M-token prompt
(87,500 blocks of 16) held the loop for ~130 ms and every other request, ``/health`` included,
waited. A thread does not help much: each XXH3 call is on a 64-byte block, far below the size at
which xxhash releases the GIL, so the hashing thread holds the GIL but for the interpreter's
switch interval and the loop crawls meanwhile (measured: docs/router.md, "Limits"). So a prompt
longer than ``slice_blocks`` is hashed here in slices of that many blocks (~2 ms each), yielding
to the loop between slices. The result is always :func:`kvindex.hashing.sequence_hashes`'.

Prompts up to ``memo_max_blocks`` go through the router's :class:`PrefixHashMemo`, one growing
prefix per slice: each call finds the previous slices' segments remembered and hashes only the
new one, and a prompt seen before costs only the memo's digest. Longer prompts bypass the memo
(its last call takes the whole prompt at once, and they would evict most of it) and chain plain
slices.
"""

from __future__ import annotations

import asyncio
from array import array
from collections.abc import Sequence

from kvindex.hashing import chain_hashes, identity_tag, local_hashes_of_bytes, token_bytes
from kvindex.prefix_memo import PrefixHashMemo

SLICE_BLOCKS = 2048
MEMO_MAX_BLOCKS = 16_384  # 262,144 tokens of 16: its last call, the whole prompt at once, is ~5 ms


class PromptHasher:
    def __init__(
        self, memo: PrefixHashMemo, slice_blocks: int = SLICE_BLOCKS, memo_max_blocks: int = MEMO_MAX_BLOCKS
    ) -> None:
        if slice_blocks < 1:
            raise ValueError(f"slice_blocks must be at least 1, got {slice_blocks}")
        self.memo = memo
        self._slice_blocks = slice_blocks
        self._memo_max_blocks = memo_max_blocks
        self.in_progress = 0  # prompts being hashed in slices now
        self.sliced = 0  # prompts hashed in slices so far

    async def chain(
        self, tokens: Sequence[int], block_size: int, cache_salt: str | None = None, lora_name: str | None = None
    ) -> list[int]:
        """The prompt's chained block hashes (full blocks only), with the request's identity (its
        cache_salt and LoRA adapter) in the first, as the agent hashes what the engine stored."""
        blocks = len(tokens) // block_size if block_size > 0 else 0
        if blocks <= self._slice_blocks:
            return self.memo.sequence_hashes(tokens, block_size, lora_name=lora_name, cache_salt=cache_salt)
        ids = tokens if isinstance(tokens, array) and tokens.typecode == "I" else array("I", tokens)
        self.in_progress += 1
        self.sliced += 1
        try:
            if blocks <= self._memo_max_blocks:
                return await self._through_memo(ids, blocks, block_size, cache_salt, lora_name)
            return await self._plain(ids, blocks, block_size, cache_salt, lora_name)
        finally:
            self.in_progress -= 1

    async def _through_memo(
        self, ids: array, blocks: int, block_size: int, cache_salt: str | None, lora_name: str | None
    ) -> list[int]:
        for end in range(self._slice_blocks, blocks, self._slice_blocks):
            self.memo.sequence_hashes(ids[: end * block_size], block_size, lora_name=lora_name, cache_salt=cache_salt)
            await asyncio.sleep(0)
        return self.memo.sequence_hashes(ids, block_size, lora_name=lora_name, cache_salt=cache_salt)

    async def _plain(
        self, ids: array, blocks: int, block_size: int, cache_salt: str | None, lora_name: str | None
    ) -> list[int]:
        data = token_bytes(ids)
        stride = 4 * block_size
        identity = identity_tag(lora_name, cache_salt)
        chain: list[int] = []
        for start in range(0, blocks, self._slice_blocks):
            piece = data[start * stride : (start + self._slice_blocks) * stride]
            local = local_hashes_of_bytes(piece, block_size)
            chain.extend(chain_hashes(local, None if chain else identity, chain[-1] if chain else None))
            await asyncio.sleep(0)
        return chain
