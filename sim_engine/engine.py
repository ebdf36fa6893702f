"""The simulated engine core: a scheduler over the block pool with a timing model.

Each engine step (as in vLLM v1): running requests are scheduled first (one decode token each;
when a block runs out and none is free, the most recently admitted request is preempted: its
blocks are freed and it is recomputed later), then waiting requests are admitted in arrival
order while the batch limit and the free blocks allow. The step's KV events are published at
schedule time, before the "forward pass", which takes

    step_overhead + uncached prompt tokens x prefill_per_token + (any decodes ? decode_step : 0)

divided by ``speedup``. Output tokens are pseudo-random (the KV cache is what is simulated).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import deque
from dataclasses import dataclass, field

from sim_engine.block_pool import Block, BlockPool, chain_hashes
from sim_engine.kv_events import KVEventPublisher

FIRST_ORDINARY_TOKEN = 5  # below: <unk>, <s>, </s> and the chat markers of the tiny model


@dataclass(frozen=True)
class TimingModel:
    prefill_ms_per_1k_tokens: float = 100.0  # uncached prompt tokens
    decode_ms_per_step: float = 20.0
    step_overhead_ms: float = 1.0
    max_running: int = 64
    speedup: float = 1.0

    def __post_init__(self) -> None:
        if min(self.prefill_ms_per_1k_tokens, self.decode_ms_per_step, self.step_overhead_ms) < 0:
            raise ValueError("timing parameters must be >= 0")
        if self.max_running < 1 or self.speedup <= 0:
            raise ValueError("max_running must be >= 1 and speedup > 0")

    def step_seconds(self, prefill_tokens: int, decoding: bool) -> float:
        ms = self.step_overhead_ms + prefill_tokens * self.prefill_ms_per_1k_tokens / 1000
        if decoding:
            ms += self.decode_ms_per_step
        return ms / 1000 / self.speedup


class RequestRejected(ValueError):
    """A request the engine cannot serve (too long for the model or the cache)."""


@dataclass
class SimRequest:
    request_id: str
    prompt: list[int]
    max_tokens: int
    salt: str | None = None
    output: list[int] = field(default_factory=list)
    blocks: list[Block] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # full blocks of prompt + output
    num_computed: int = 0
    num_cached_blocks: int = 0
    cached_tokens: int | None = None  # the prefix hit when first scheduled
    prefilling: bool = False
    arrived: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    tokens: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)  # None: finished

    @property
    def all_tokens(self) -> list[int]:
        return self.prompt + self.output


@dataclass
class EngineStats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    preemptions: int = 0
    requests_finished: int = 0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SimEngine:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        timing: TimingModel,
        publisher: KVEventPublisher | None = None,
        max_model_len: int = 4096,
        vocab_size: int = 2048,
    ) -> None:
        self.pool = BlockPool(num_blocks, block_size)
        self.timing = timing
        self.publisher = publisher
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.stats = EngineStats()
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> SimEngine:
        self._task = asyncio.create_task(self._loop())
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def submit(self, request: SimRequest) -> SimRequest:
        total = len(request.prompt) + request.max_tokens
        if not request.prompt:
            raise RequestRejected("the prompt is empty")
        if total > self.max_model_len:
            raise RequestRejected(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{total} tokens ({len(request.prompt)} in the prompt, {request.max_tokens} in the completion)."
            )
        if _cdiv(total, self.pool.block_size) > self.pool.num_blocks - 1:
            raise RequestRejected(f"the request needs more KV blocks than the cache has ({self.pool.num_blocks - 1})")
        self.waiting.append(request)
        self._wake.set()
        return request

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    async def _loop(self) -> None:
        while True:
            if not self.running and not self.waiting:
                self._wake.clear()
                await self._wake.wait()
            prefill_tokens, decoding = self._schedule()
            events = self.pool.take_events()
            if events and self.publisher is not None:
                await self.publisher.publish(events)
            await asyncio.sleep(self.timing.step_seconds(prefill_tokens, decoding))
            self._advance()

    # --- scheduling ----------------------------------------------------------------------

    def _schedule(self) -> tuple[int, bool]:
        decoding = self._schedule_running()
        prefill_tokens = 0
        while self.waiting and len(self.running) < self.timing.max_running:
            to_compute = self._admit(self.waiting[0])
            if to_compute is None:
                break
            admitted = self.waiting.popleft()
            admitted.prefilling = True
            self.running.append(admitted)
            prefill_tokens += to_compute
        return prefill_tokens, decoding

    def _schedule_running(self) -> bool:
        scheduled = 0
        while scheduled < len(self.running):
            request = self.running[scheduled]
            needed = max(_cdiv(request.num_computed + 1, self.pool.block_size) - len(request.blocks), 0)
            if not self._make_room(needed, request):
                continue  # the request itself was preempted (it was the last one)
            request.blocks += self.pool.allocate(needed)
            self._cache(request, min(request.num_computed + 1, len(request.all_tokens)))
            scheduled += 1
        return scheduled > 0

    def _make_room(self, needed: int, request: SimRequest) -> bool:
        """Preempt the latest admitted requests until ``needed`` blocks are free; False when
        ``request`` itself had to go."""
        while needed > self.pool.num_free:
            victim = self.running.pop()
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _admit(self, request: SimRequest) -> int | None:
        """Admit ``request`` if its blocks fit: the prompt tokens left to compute, else None."""
        tokens = request.all_tokens
        request.hashes = chain_hashes(tokens, self.pool.block_size, request.salt)
        hit = self.pool.longest_hit(request.hashes, len(tokens))
        needed = _cdiv(len(tokens), self.pool.block_size) - len(hit)
        if needed + self.pool.evictable(hit) > self.pool.num_free:
            return None
        self.pool.touch(hit)
        request.blocks = hit + self.pool.allocate(needed)
        request.num_cached_blocks = len(hit)
        if request.cached_tokens is None:
            request.cached_tokens = len(hit) * self.pool.block_size
            self.stats.prompt_tokens += len(request.prompt)
        self.stats.prefix_queries += len(tokens)
        self.stats.prefix_hits += len(hit) * self.pool.block_size
        self._cache(request, len(tokens))
        return len(tokens) - len(hit) * self.pool.block_size

    def _cache(self, request: SimRequest, num_tokens: int) -> None:
        full = num_tokens // self.pool.block_size
        tokens = request.all_tokens
        if full > len(request.hashes):
            parent = request.hashes[-1] if request.hashes else None
            request.hashes += chain_hashes(
                tokens[: full * self.pool.block_size],
                self.pool.block_size,
                request.salt,
                start=len(request.hashes),
                parent=parent,
            )
        self.pool.cache(request.blocks, request.hashes[:full], tokens, request.num_cached_blocks, request.salt)
        request.num_cached_blocks = max(request.num_cached_blocks, min(full, len(request.blocks)))

    def _preempt(self, request: SimRequest) -> None:
        self.pool.free(list(reversed(request.blocks)))
        request.blocks, request.num_computed, request.num_cached_blocks = [], 0, 0
        request.prefilling = False
        self.stats.preemptions += 1
        self.waiting.appendleft(request)

    # --- after the forward pass -------------------------------------------------------------

    def _advance(self) -> None:
        for request in list(self.running):
            if request.prefilling:
                request.num_computed = len(request.all_tokens)
                request.prefilling = False
            else:
                request.num_computed += 1
            token = self._next_token(request)
            request.output.append(token)
            self.stats.generation_tokens += 1
            if request.first_token_at is None:
                request.first_token_at = time.monotonic()
            request.tokens.put_nowait(token)
            if len(request.output) >= request.max_tokens:
                self._finish(request)

    def _next_token(self, request: SimRequest) -> int:
        rng = random.Random(f"{request.request_id}:{len(request.output)}")
        return rng.randrange(FIRST_ORDINARY_TOKEN, self.vocab_size)

    def _finish(self, request: SimRequest) -> None:
        self.running.remove(request)
        self.pool.free(list(reversed(request.blocks)))
        request.blocks = []
        self.stats.requests_finished += 1
        request.tokens.put_nowait(None)
        request.finished.set()

    def abort(self, request: SimRequest) -> None:
        """The client went away: drop the request and free its blocks."""
        if request in self.running:
            self._finish(request)
        elif request in self.waiting:
            self.waiting.remove(request)
            request.finished.set()
