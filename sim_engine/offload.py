"""A CPU tier behind the simulated engine's GPU cache, as vLLM's native CPU offloading
(OffloadingConnector) keeps one: every block the GPU caches is copied to host memory (write
through), kept there least recently used first out, and announced in KV events with
``medium="CPU"`` (BlockStored when copied, BlockRemoved when evicted). A request's prefix past its
GPU hit that the CPU holds (consecutive blocks) is loaded instead of computed, at
``load_ms_per_1k_tokens``; the engine reports those tokens cached, as vLLM counts a connector's
tokens with the local hits (``vllm:prompt_tokens_by_source`` says which were external).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvevents.vllm import Event
from sim_engine.block_pool import CacheKeys
from sim_engine.kv_events import removed_event, stored_event

CPU = "CPU"


class CpuTier:
    def __init__(
        self, num_blocks: int, block_size: int, load_ms_per_1k_tokens: float, emit: Callable[[Event], None]
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"a CPU tier holds at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.load_ms_per_1k_tokens = load_ms_per_1k_tokens
        self._held: OrderedDict[int, None] = OrderedDict()  # block hashes, least recently used first
        self._emit = emit  # into the engine's events: published with the step

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._held

    def store(self, hashes: Sequence[int], tokens: Sequence[int], start: int, keys: CacheKeys) -> None:
        """Copy the full blocks ``hashes[start:]`` (of ``tokens``) here; those already held are
        touched. One BlockStored per run of new blocks, chained to the block before it."""
        run: list[int] = []
        first = start
        for i in range(start, len(hashes)):
            block = hashes[i]
            if block in self._held:
                self._held.move_to_end(block)
                self._announce(run, first, hashes, tokens, keys)
                run, first = [], i + 1
                continue
            run.append(block)
        self._announce(run, first, hashes, tokens, keys)

    def _announce(
        self, run: list[int], first: int, hashes: Sequence[int], tokens: Sequence[int], keys: CacheKeys
    ) -> None:
        if not run:
            return
        self._make_room(len(run))
        for block in run:
            self._held[block] = None
        size = self.block_size
        extra = [list(e) if (e := keys.extra(i)) else None for i in range(first, first + len(run))]
        self._emit(
            stored_event(
                run,
                hashes[first - 1] if first else None,
                tokens[first * size : (first + len(run)) * size],
                size,
                extra_keys=extra,
                lora_name=keys.lora_name,
                lora_id=keys.lora_id,
                medium=CPU,
            )
        )

    def _make_room(self, count: int) -> None:
        evicted = []
        while self._held and len(self._held) + count > self.num_blocks:
            evicted.append(self._held.popitem(last=False)[0])
        if evicted:
            self._emit(removed_event(evicted, medium=CPU))

    def hit(self, hashes: Sequence[int], start: int, limit: int, touch: bool = True) -> int:
        """How many consecutive blocks from ``hashes[start]`` this tier holds (at most ``limit``);
        with ``touch`` they are used (a load)."""
        count = 0
        while count < limit and start + count < len(hashes) and hashes[start + count] in self._held:
            if touch:
                self._held.move_to_end(hashes[start + count])
            count += 1
        return count

    def load_ms(self, blocks: int) -> float:
        return blocks * self.block_size * self.load_ms_per_1k_tokens / 1000

    def clear(self) -> None:
        """A prefix-cache reset empties this tier too (its AllBlocksCleared is the GPU's)."""
        self._held.clear()
