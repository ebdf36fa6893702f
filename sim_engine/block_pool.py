"""A KV block pool with vLLM v1's prefix-caching semantics, emitting vLLM's KV events.

What is reproduced (vllm/v1/core/block_pool.py, kv_cache_manager.py, as of 0.32/0.33):
* Block 0 is the null block and is never handed out: N blocks give N - 1 usable ones.
* Free blocks wait in a queue. A request's blocks are freed in reverse order; the cached ones
  join the end of the queue (LRU: a chain is evicted from its tail), the ones without a hash go
  to its front, to be reused first. Touching a cached free block (a prefix hit) takes it out of
  the queue.
* Allocation pops the queue's head; a popped block that still holds a cached hash is evicted
  from the cache first (a BlockRemoved event, one hash per event).
* Full blocks are cached by their chained hash when they are scheduled (BlockStored with the
  parent's hash, the blocks' token ids and, on a chain's first block, the request's cache_salt
  as its extra key). Several physical blocks may hold one hash: a fully cached prompt recomputes
  its last block, which is stored (and later removed) again.
* A prefix hit is the longest run of cached blocks, capped at ``prompt length - 1`` tokens.
* ``reset_prefix_cache`` works only when no block is in use; it forgets every hash and emits one
  AllBlocksCleared (no per-block removals).
* A hybrid model's KV-cache groups share the pool (vLLM's HybridKVCacheCoordinator gives every
  group's manager the same BlockPool): a block is handed to one group's table at a time, and cached
  under (group, hash), so one hash may be cached in both groups (the same tokens hash alike in
  each), each copy announced and removed with its ``group_idx`` (sim_engine/hybrid.py).

The engine hash is sha256 over (parent, tokens, extra keys), low 64 bits, like vLLM's default
(the exact bytes differ: consumers must not rely on them, and the agent does not).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvevents.events import Event
from sim_engine.kv_events import cleared_event, removed_event, stored_event

NONE_HASH = int.from_bytes(hashlib.sha256(b"kvroute-sim-none-hash").digest()[:8], "little")


@dataclass(frozen=True)
class CacheKeys:
    """What keeps one request's cached blocks apart from another's with the same tokens: vLLM's
    extra keys, the LoRA adapter's name on every block and the cache_salt after it on the first
    (tests/fixtures/vllm-0.32-cpu/captures/run4_lora_events.txt). ``lora_id`` is the adapter's
    number in the engine (its KV events carry it)."""

    salt: str | None = None
    lora_name: str | None = None
    lora_id: int | None = None

    def extra(self, index: int) -> tuple[str, ...] | None:
        """Block ``index``'s extra keys (None: none)."""
        keys: tuple[str, ...] = (self.lora_name,) if self.lora_name else ()
        if self.salt and index == 0:
            keys += (self.salt,)
        return keys or None


def block_hash(parent: int | None, tokens: Sequence[int], extra: tuple[str, ...] | None) -> int:
    data = struct.pack(f"<Q{len(tokens)}I", NONE_HASH if parent is None else parent, *tokens)
    if extra:
        data += repr(extra).encode()
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little")


def chain_hashes(
    tokens: Sequence[int], block_size: int, keys: CacheKeys, start: int = 0, parent: int | None = None
) -> list[int]:
    """Hashes of the full blocks of ``tokens`` from block ``start`` on (``parent``: block start-1's)."""
    out = []
    for i in range(start, len(tokens) // block_size):
        parent = block_hash(parent, tokens[i * block_size : (i + 1) * block_size], keys.extra(i))
        out.append(parent)
    return out


@dataclass(frozen=True)
class CachedContent:
    """What a cached hash stands for: its parent's hash (None on a chain's first block), the
    block's token ids, the salt of a chain's first block and the LoRA adapter of every block (the
    engine's debug view)."""

    parent: int | None
    tokens: tuple[int, ...]
    salt: str | None
    lora_name: str | None = None


@dataclass(frozen=True)
class KVCacheGroup:
    """A KV-cache group's spec as its KV events name it (``kv_cache_spec_kind``, and the window of
    a sliding-window group)."""

    kind: str = "full_attention"
    sliding_window: int | None = None


FULL_ATTENTION = KVCacheGroup()


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    hash: int | None = None  # set while the block is in the prefix cache
    group: int = 0  # the KV-cache group it is cached for (while it has a hash)


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, groups: Sequence[KVCacheGroup] = (FULL_ATTENTION,)) -> None:
        if num_blocks < 2:
            raise ValueError("num_blocks must be at least 2 (block 0 is vLLM's null block)")
        if block_size < 1:
            raise ValueError("block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.groups = tuple(groups)
        self.blocks = [Block(i) for i in range(num_blocks)]
        # vLLM's placeholder for the blocks a sliding window no longer reads: never free, never cached
        self.null = self.blocks[0]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        # per group: hash -> the blocks holding it (several copies may)
        self._cached: list[dict[int, dict[int, Block]]] = [{} for _ in self.groups]
        self._content: dict[int, CachedContent] = {}  # per cached hash, for the debug view
        self.events: list[Event] = []  # published with the next engine step

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """vLLM's kv_cache_usage_perc: cached but unused blocks count as free."""
        return 1.0 - self.num_free / (self.num_blocks - 1)

    def emit(self, event: Event) -> None:
        """Add an event to this step's (the lower tiers' go out with the pool's)."""
        self.events.append(event)

    def take_events(self) -> list[Event]:
        events, self.events = self.events, []
        return events

    def cached_hashes(self) -> list[int]:
        """Every cached hash (once, whichever groups hold it)."""
        return list(dict.fromkeys(h for cached in self._cached for h in cached))

    def cached_contents(self) -> dict[int, CachedContent]:
        """Every cached hash with its parent, tokens and salt (a consumer can rehash the chains)."""
        return dict(self._content)

    def cached_block(self, hash_: int, group: int = 0) -> Block | None:
        copies = self._cached[group].get(hash_)
        return next(iter(copies.values())) if copies else None

    def longest_hit(self, hashes: Sequence[int], num_tokens: int, group: int = 0) -> list[Block]:
        """Cached blocks for the leading hashes, at most (num_tokens - 1) // block_size of them."""
        hit = []
        for hash_ in hashes[: (num_tokens - 1) // self.block_size]:
            block = self.cached_block(hash_, group)
            if block is None:
                break
            hit.append(block)
        return hit

    def evictable(self, blocks: Sequence[Block]) -> int:
        """How many of ``blocks`` sit in the free queue (touching them uses up free blocks)."""
        return sum(1 for b in blocks if b.ref_cnt == 0 and b is not self.null)

    def touch(self, blocks: Sequence[Block]) -> None:
        for block in blocks:
            if block is self.null:
                continue
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def allocate(self, count: int) -> list[Block]:
        if count > len(self._free):
            raise NoFreeBlocksError(f"{count} blocks needed, {len(self._free)} free")
        out = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: Block) -> None:
        if block.hash is None:
            return
        cached = self._cached[block.group]
        copies = cached[block.hash]
        del copies[block.block_id]
        if not copies:
            del cached[block.hash]
            if not any(block.hash in other for other in self._cached):
                del self._content[block.hash]
        self.events.append(removed_event([block.hash], group_idx=block.group))
        block.hash = None

    def free(self, blocks: Iterable[Block]) -> None:
        """Release a request's blocks, given in eviction order (its tail first). Cached blocks go
        to the end of the queue (LRU); blocks without a hash go to the front, in that order, to be
        reused first (vLLM's LIFO reuse of blocks that can never be a prefix hit). The null block
        is skipped (a sliding window's table holds it where blocks slid out)."""
        reuse_first = []
        for block in blocks:
            if block is self.null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.hash is None:
                    reuse_first.append(block.block_id)
                else:
                    self._free[block.block_id] = None
        for block_id in reversed(reuse_first):
            self._free[block_id] = None
            self._free.move_to_end(block_id, last=False)

    def cache(
        self,
        blocks: Sequence[Block],
        hashes: Sequence[int],
        tokens: Sequence[int],
        start: int,
        keys: CacheKeys,
        *,
        group: int = 0,
        mask: Sequence[bool] | None = None,
    ) -> None:
        """Cache ``blocks[start:]`` under ``hashes[start:]`` (full blocks only) for ``group`` and
        announce them. ``mask`` (one flag per block from ``start``) leaves out the blocks no later
        hit can use, and null blocks are left out, as vLLM's ``cache_full_blocks``: the event still
        carries the whole span's tokens, with the hashes and extra keys of the cached blocks only."""
        stop = min(len(blocks), len(hashes))
        if stop <= start:
            return
        size = self.block_size
        kept = [i for i in range(start, stop) if blocks[i] is not self.null and (mask is None or mask[i - start])]
        for i in kept:
            block, hash_ = blocks[i], hashes[i]
            block.hash, block.group = hash_, group
            self._cached[group].setdefault(hash_, {})[block.block_id] = block
            parent = hashes[i - 1] if i else None
            self._content[hash_] = CachedContent(
                parent, tuple(tokens[i * size : (i + 1) * size]), keys.salt if i == 0 else None, keys.lora_name
            )
        spec = self.groups[group]
        self.events.append(
            stored_event(
                [hashes[i] for i in kept],
                hashes[start - 1] if start else None,
                tokens[start * size : stop * size],
                size,
                extra_keys=[list(e) if (e := keys.extra(i)) else None for i in kept],
                lora_name=keys.lora_name,
                lora_id=keys.lora_id,
                group_idx=group,
                kv_cache_spec_kind=spec.kind,
                kv_cache_spec_sliding_window=spec.sliding_window,
            )
        )

    def reset_prefix_cache(self) -> bool:
        if self.num_free < self.num_blocks - 1:
            return False  # vLLM refuses while requests hold blocks
        for cached in self._cached:
            cached.clear()
        self._content.clear()
        for block in self.blocks:
            block.hash = None
        self.events.append(cleared_event())
        return True
