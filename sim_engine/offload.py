"""The lower cache tiers behind the simulated engine's GPU cache, each a write-through copy of it:

* a CPU tier, as vLLM's native CPU offloading (OffloadingConnector) keeps one in host memory;
* a disk tier, as LMCache's local-disk backend keeps one behind its CPU cache: larger and slower.

Every block the GPU caches is copied to each tier (write through), kept there least recently used
first out, and announced in KV events with the tier's ``medium`` (``"CPU"``, ``"DISK"``:
BlockStored when copied, BlockRemoved when evicted). Past a request's GPU hit, the engine loads
the prompt's prefix from the tiers in load order, each block from the fastest tier that holds it:
the CPU's consecutive run first, then the disk's consecutive run from where the CPU's ended (what
the router's ``router.routing.tiers.loadable`` predicts), each at its ``load_ms_per_1k_tokens``,
the request waiting for the sum; the engine reports those tokens cached, as vLLM counts a
connector's tokens with the local hits (``vllm:prompt_tokens_by_source`` says which were external).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvevents.events import Event
from sim_engine.block_pool import CacheKeys
from sim_engine.kv_events import removed_event, stored_event
from sim_engine.types import SimRequest

CPU = "CPU"
DISK = "DISK"
LOAD_ORDER = (CPU, DISK)  # the fastest first (kvindex/tiers.py's TIERS)


class LowerTier:
    """One tier behind the GPU cache, its blocks announced with ``medium``."""

    def __init__(
        self,
        medium: str,
        num_blocks: int,
        block_size: int,
        load_ms_per_1k_tokens: float,
        emit: Callable[[Event], None],
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"a {medium} tier holds at least one block, got {num_blocks}")
        self.medium = medium
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
                medium=self.medium,
            )
        )
        self._make_room(0)  # a run longer than the whole tier: its first blocks go again

    def _make_room(self, count: int) -> None:
        evicted = []
        while self._held and len(self._held) + count > self.num_blocks:
            evicted.append(self._held.popitem(last=False)[0])
        if evicted:
            self._emit(removed_event(evicted, medium=self.medium))

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


class CpuTier(LowerTier):
    """Host memory, as vLLM's native CPU offloading."""

    def __init__(
        self, num_blocks: int, block_size: int, load_ms_per_1k_tokens: float, emit: Callable[[Event], None]
    ) -> None:
        super().__init__(CPU, num_blocks, block_size, load_ms_per_1k_tokens, emit)


class DiskTier(LowerTier):
    """A local disk behind the CPU tier, as LMCache's local-disk backend."""

    def __init__(
        self, num_blocks: int, block_size: int, load_ms_per_1k_tokens: float, emit: Callable[[Event], None]
    ) -> None:
        super().__init__(DISK, num_blocks, block_size, load_ms_per_1k_tokens, emit)


class LowerTiers:
    """An engine's lower tiers in load order (none: an engine with its GPU cache alone)."""

    def __init__(self, tiers: Sequence[LowerTier] = ()) -> None:
        self.tiers = tuple(sorted(tiers, key=lambda t: LOAD_ORDER.index(t.medium)))

    @classmethod
    def build(
        cls,
        block_size: int,
        emit: Callable[[Event], None],
        cpu: tuple[int, float] = (0, 0.0),
        disk: tuple[int, float] = (0, 0.0),
    ) -> LowerTiers:
        """The tiers of ``cpu`` and ``disk`` blocks (each with its load ms per 1k tokens; 0 blocks: none)."""
        tiers: list[LowerTier] = []
        if cpu[0]:
            tiers.append(CpuTier(cpu[0], block_size, cpu[1], emit))
        if disk[0]:
            tiers.append(DiskTier(disk[0], block_size, disk[1], emit))
        return cls(tiers)

    def __bool__(self) -> bool:
        return bool(self.tiers)

    def of(self, medium: str) -> LowerTier | None:
        return next((t for t in self.tiers if t.medium == medium), None)

    def store(self, hashes: Sequence[int], tokens: Sequence[int], start: int, keys: CacheKeys) -> None:
        """Write through: each tier copies the full blocks ``hashes[start:]`` the GPU caches."""
        for tier in self.tiers:
            tier.store(hashes, tokens, start, keys)

    def runs(self, hashes: Sequence[int], start: int, limit: int, touch: bool = True) -> tuple[int, ...]:
        """The blocks each tier would load past ``hashes[start]`` (the GPU's hit), at most ``limit``
        in all: each tier's consecutive run from where the tier before it ended."""
        loaded = []
        for tier in self.tiers:
            count = tier.hit(hashes, start, limit, touch)
            loaded.append(count)
            start += count
            limit -= count
        return tuple(loaded)

    def load_ms(self, runs: Sequence[int]) -> float:
        """The time to load ``runs`` (each tier's blocks, as :meth:`runs` counts them), one after the other."""
        return sum(tier.load_ms(blocks) for tier, blocks in zip(self.tiers, runs, strict=True))

    def admit(self, request: SimRequest, held: int, limit: int, speedup: float) -> int:
        """Load what the tiers hold of ``request``'s prompt past its ``held`` GPU blocks (at most
        ``limit`` blocks, as many as vLLM counts): how many blocks; the request waits until its
        ``ready_at``. Loaded asynchronously, as vLLM's connectors load: the request holds its blocks
        and waits (vLLM's WAITING_FOR_REMOTE_KVS) while the others compute; its prefill starts in
        the first step after the load."""
        if not self.tiers:
            return 0
        runs = self.runs(request.hashes, held, limit)
        loaded = sum(runs)
        if request.cached_tokens is None:  # first admitted: what it reports as external
            request.external_tokens = loaded * self.tiers[0].block_size
        if loaded:
            request.ready_at = time.monotonic() + self.load_ms(runs) / 1000 / speedup
        return loaded

    def clear(self) -> None:
        """A prefix-cache reset empties every tier."""
        for tier in self.tiers:
            tier.clear()
