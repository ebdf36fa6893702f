"""The simulated engine core: vLLM v1's scheduler over the block pool, with a timing model.

Each engine step, as vLLM v1's ``Scheduler.schedule`` (FCFS, synchronous scheduling):

* a token budget of ``max_num_batched_tokens`` (0: no budget) is shared by the step's requests;
* running requests first, in admission order: a decode costs 1 token, a partially prefilled
  request continues with min(its remaining tokens, the remaining budget); when a block is needed
  and none is free, the latest admitted running request is preempted (freed, recomputed later
  from its prefix-cache hit); the loop stops when the budget is spent;
* then, only if nobody was preempted in this step, waiting requests in arrival order while budget
  remains and fewer than ``max_num_seqs`` run: each gets its prefix-cache hit, then
  min(remaining tokens, remaining budget) new tokens. Admission needs free blocks for the whole
  sequence (vLLM's ``scheduler_reserve_full_isl``); the first request that does not fit stops it.

Blocks are allocated, and full blocks cached (BlockStored), for the tokens scheduled in the step,
as vLLM's ``allocate_slots`` does. A request samples its next token in the step that computes its
last token (its first token: the step of its last prompt chunk). The step's KV events are
published at schedule time, before the "forward pass", which takes

    step_overhead + prefill tokens x prefill_per_token
      + (decodes ? decode_step + decodes x decode_per_token : 0)

divided by ``speedup``, where a chunk of N new tokens after P computed ones costs
``N x prefill_per_token + prefill_context_ns x N x (P + N / 2)`` (attention over the context).
With ``parallel_prefill`` each request has its own token budget and the step takes its longest
chunk's time instead of their sum. Output tokens are pseudo-random (the KV cache is what is simulated).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from sim_engine.block_pool import Block, BlockPool, CacheKeys, chain_hashes
from sim_engine.faults import EngineFaults
from sim_engine.kv_events import KVEventPublisher
from sim_engine.offload import CpuTier

FIRST_ORDINARY_TOKEN = 5  # below: <unk>, <s>, </s> and the chat markers of the tiny model

# vLLM 0.32's default for its OpenAI server on GPUs under 70 GiB and on CPUs (H100/H200: 8192;
# 160 GiB and more: 16384); docs/sim-engine.md says more.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_MAX_NUM_SEQS = 64  # this engine's batch limit before it had vLLM's name (vLLM: 256 on GPUs)


@dataclass(frozen=True, init=False)
class TimingModel:
    """The scheduler's limits and the step time model.

    ``max_num_seqs`` is vLLM's name for the batch limit; ``max_running`` (keyword and attribute)
    is the same setting under its older name here."""

    prefill_ms_per_1k_tokens: float  # uncached prompt tokens
    decode_ms_per_step: float  # a step with any decode
    step_overhead_ms: float
    max_num_seqs: int
    speedup: float
    max_num_batched_tokens: int  # per-step token budget (chunked prefill); 0: none
    decode_ms_per_token: float  # per decoding request in the step (a large batch decodes slower)
    # Attention grows with the context: a chunk of N new tokens after P computed ones costs
    # this many ns x N x (P + N / 2) more (0: prefill time linear in new tokens alone).
    prefill_context_ns: float
    # Each request's prefill in its own lane: the token budget is per request, and a step takes
    # as long as its longest prefill chunk, not their sum (an engine far from saturating its GPU).
    parallel_prefill: bool

    def __init__(
        self,
        prefill_ms_per_1k_tokens: float = 100.0,
        decode_ms_per_step: float = 20.0,
        step_overhead_ms: float = 1.0,
        max_num_seqs: int | None = None,
        speedup: float = 1.0,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        decode_ms_per_token: float = 0.0,
        prefill_context_ns: float = 0.0,
        parallel_prefill: bool = False,
        *,
        max_running: int | None = None,
    ) -> None:
        if max_num_seqs is not None and max_running is not None and max_num_seqs != max_running:
            raise ValueError("max_running is max_num_seqs under its old name: give one of them")
        seqs = next((v for v in (max_num_seqs, max_running) if v is not None), DEFAULT_MAX_NUM_SEQS)
        values = {
            "prefill_ms_per_1k_tokens": prefill_ms_per_1k_tokens,
            "decode_ms_per_step": decode_ms_per_step,
            "step_overhead_ms": step_overhead_ms,
            "max_num_seqs": seqs,
            "speedup": speedup,
            "max_num_batched_tokens": max_num_batched_tokens,
            "decode_ms_per_token": decode_ms_per_token,
            "prefill_context_ns": prefill_context_ns,
            "parallel_prefill": bool(parallel_prefill),
        }
        for name, value in values.items():
            object.__setattr__(self, name, value)
        self._validate()

    def _validate(self) -> None:
        timings = (self.prefill_ms_per_1k_tokens, self.decode_ms_per_step, self.step_overhead_ms)
        if min(*timings, self.decode_ms_per_token, self.prefill_context_ns) < 0:
            raise ValueError("timing parameters must be >= 0")
        if self.max_num_seqs < 1 or self.speedup <= 0:
            raise ValueError("--max-num-seqs must be >= 1 and --speedup > 0")
        if self.max_num_batched_tokens < 0:
            raise ValueError("--max-num-batched-tokens must be >= 0 (0: no per-step budget)")
        if 0 < self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"--max-num-batched-tokens ({self.max_num_batched_tokens}) must be >= --max-num-seqs "
                f"({self.max_num_seqs}), as vLLM requires (or 0: no per-step budget)"
            )

    @property
    def max_running(self) -> int:
        """``max_num_seqs`` under its old name."""
        return self.max_num_seqs

    @property
    def token_budget(self) -> int:
        """The tokens one step may schedule (``max_num_batched_tokens``, unbounded when 0)."""
        return self.max_num_batched_tokens or sys.maxsize

    def chunk_ms(self, new_tokens: int, context_tokens: int) -> float:
        """The prefill of ``new_tokens`` after ``context_tokens`` already computed, in ms."""
        linear = new_tokens * self.prefill_ms_per_1k_tokens / 1000
        return linear + self.prefill_context_ns * new_tokens * (context_tokens + new_tokens / 2) / 1e6

    def step_seconds(self, prefill_tokens: int, decodes: int, prefill_ms: float | None = None) -> float:
        """A step's duration: ``decodes`` is how many requests decode in it (a bool counts as 0 or 1);
        ``prefill_ms`` the step's prefill time when known (:attr:`StepPlan.prefill_ms`), else
        ``prefill_tokens`` at the linear rate."""
        if prefill_ms is None:
            prefill_ms = prefill_tokens * self.prefill_ms_per_1k_tokens / 1000
        ms = self.step_overhead_ms + prefill_ms
        if decodes:
            ms += self.decode_ms_per_step + int(decodes) * self.decode_ms_per_token
        return ms / 1000 / self.speedup


class RequestRejected(ValueError):
    """A request the engine cannot serve (too long for the model or the cache)."""


@dataclass(eq=False)
class SimRequest:
    request_id: str
    prompt: list[int]
    max_tokens: int
    keys: CacheKeys = field(default_factory=CacheKeys)  # its cache_salt and LoRA adapter
    output: list[int] = field(default_factory=list)
    blocks: list[Block] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # full blocks of prompt + output
    num_computed: int = 0  # tokens whose KV is computed (after the step that scheduled them)
    num_cached_blocks: int = 0
    cached_tokens: int | None = None  # the prefix hit when first scheduled (loaded from the CPU tier too)
    external_tokens: int = 0  # of those, the ones loaded from the CPU tier
    ready_at: float = 0.0  # monotonic time its load from the CPU tier ends: computed from then on
    prefilling: bool = False  # admitted, and its computed tokens have not caught up with its tokens yet
    num_preemptions: int = 0
    arrived: float = field(default_factory=time.monotonic)
    scheduled_at: float | None = None  # first scheduled (vLLM's scheduled_ts: preemptions do not move it)
    first_token_at: float | None = None
    token_times: list[float] = field(default_factory=list)  # when each output token was sampled
    finished_at: float | None = None
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    tokens: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)  # None: finished

    @property
    def all_tokens(self) -> list[int]:
        return self.prompt + self.output


@dataclass
class StepPlan:
    """What one engine step computes: the scheduled requests with their token counts, in
    schedule order (running requests, then the newly admitted ones), and who was preempted."""

    scheduled: list[tuple[SimRequest, int]] = field(default_factory=list)
    prefill_tokens: int = 0  # tokens of requests in (re)computation: prompt chunks, recomputed outputs
    prefill_ms: float = 0.0  # their compute time (summed, or the longest chunk's with parallel prefill)
    decodes: int = 0  # requests decoding one token
    preempted: list[SimRequest] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.prefill_tokens + self.decodes

    def tokens_of(self, request: SimRequest) -> int:
        return next((n for r, n in self.scheduled if r is request), 0)


@dataclass
class EngineStats:
    prompt_tokens: int = 0  # counted when the request's first token comes, as vLLM
    prompt_tokens_cached: int = 0  # of those, the prefix-cache hits when first scheduled
    prompt_tokens_external: int = 0  # of those, loaded from the CPU tier
    generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    preemptions: int = 0
    requests_finished: int = 0
    steps: int = 0


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
        on_step: Callable[[StepPlan], None] | None = None,
        faults: EngineFaults | None = None,
        cpu_blocks: int = 0,
        cpu_load_ms_per_1k_tokens: float = 4.0,
    ) -> None:
        self.pool = BlockPool(num_blocks, block_size)
        # the CPU tier behind the GPU cache (sim_engine/offload.py), its events with the pool's
        self.cpu = CpuTier(cpu_blocks, block_size, cpu_load_ms_per_1k_tokens, self.pool.emit) if cpu_blocks else None
        self.faults = faults or EngineFaults()
        self.timing = timing
        self.publisher = publisher
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.on_step = on_step  # called with each step's plan when it is scheduled (metrics)
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
        if not self.pool.reset_prefix_cache():
            return False
        if self.cpu is not None:
            self.cpu.clear()
        return True

    def cached_prefix_tokens(self, prompt: list[int], keys: CacheKeys | None = None) -> int:
        """The prefix-cache hit ``prompt`` would get if it were scheduled now, in tokens (what an
        oracle router asks: ``POST /debug/match``)."""
        size = self.pool.block_size
        hashes = chain_hashes(prompt, size, keys or CacheKeys())
        hit = len(self.pool.longest_hit(hashes, len(prompt)))
        if self.cpu is not None:
            hit += self.cpu.hit(hashes, hit, (len(prompt) - 1) // size - hit, touch=False)
        return hit * size

    async def _loop(self) -> None:
        while True:
            if not self.running and not self.waiting:
                self._wake.clear()
                await self._wake.wait()
            plan = self.schedule()
            events = self.pool.take_events()
            if events and self.publisher is not None:
                await self.publisher.publish(events, deliver=self.faults.deliver(self.publisher.next_seq))
            await asyncio.sleep(self.timing.step_seconds(plan.prefill_tokens, plan.decodes, plan.prefill_ms))
            self.complete(plan)

    # --- scheduling ----------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Schedule one step (its KV events wait in ``pool.events``); :meth:`complete` ends it."""
        plan = StepPlan()
        budget = self._schedule_running(plan, self.timing.token_budget)
        if not plan.preempted:
            self._schedule_waiting(plan, budget)
        self.stats.steps += 1
        if self.on_step is not None:
            self.on_step(plan)
        return plan

    def _schedule_running(self, plan: StepPlan, budget: int) -> int:
        index = 0
        now = time.monotonic()
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if request.ready_at > now:  # its KV is still loading from the CPU tier
                index += 1
                continue
            count = min(len(request.all_tokens) - request.num_computed, budget)
            end = request.num_computed + count
            needed = max(_cdiv(end, self.pool.block_size) - len(request.blocks), 0)
            if not self._make_room(needed, request, plan):
                break  # the request itself was preempted: it was the last one
            request.blocks += self.pool.allocate(needed)
            self._cache(request, end)
            self._add(plan, request, count)
            budget -= self._spent(count)
            index += 1
        return budget

    def _schedule_waiting(self, plan: StepPlan, budget: int) -> None:
        now = time.monotonic()
        while self.waiting and budget > 0 and len(self.running) < self.timing.max_num_seqs:
            request = self.waiting[0]
            count = self._admit(request, budget)
            if count is None:
                break  # first come, first served: nobody overtakes a request that does not fit
            self.waiting.popleft()
            request.prefilling = True
            if request.scheduled_at is None:
                request.scheduled_at = now
            self.running.append(request)
            self._add(plan, request, count)
            budget -= self._spent(count)

    def _spent(self, count: int) -> int:
        """What scheduling ``count`` tokens takes from the step's budget: nothing with parallel
        prefill, where the budget is each request's own."""
        return 0 if self.timing.parallel_prefill else count

    def _add(self, plan: StepPlan, request: SimRequest, count: int) -> None:
        plan.scheduled.append((request, count))
        if request.prefilling:
            plan.prefill_tokens += count
            chunk = self.timing.chunk_ms(count, request.num_computed)
            plan.prefill_ms = max(plan.prefill_ms, chunk) if self.timing.parallel_prefill else plan.prefill_ms + chunk
        else:
            plan.decodes += 1

    def _make_room(self, needed: int, request: SimRequest, plan: StepPlan) -> bool:
        """Preempt the latest admitted requests until ``needed`` blocks are free; False when
        ``request`` itself had to go."""
        while needed > self.pool.num_free:
            victim = self.running.pop()
            self._preempt(victim)
            plan.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _admit(self, request: SimRequest, budget: int) -> int | None:
        """Admit ``request`` if its whole sequence fits in the free blocks: the tokens scheduled
        for it in this step (its first chunk), else None."""
        tokens = request.all_tokens
        size = self.pool.block_size
        request.hashes = chain_hashes(tokens, size, request.keys)
        hit = self.pool.longest_hit(request.hashes, len(tokens))
        if _cdiv(len(tokens), size) - len(hit) + self.pool.evictable(hit) > self.pool.num_free:
            return None
        loaded = 0
        if self.cpu is not None:  # past the GPU's hit, what the CPU holds is loaded (as much as vLLM counts)
            loaded = self.cpu.hit(request.hashes, len(hit), (len(tokens) - 1) // size - len(hit))
            if request.cached_tokens is None:
                request.external_tokens = loaded * size
            if loaded:
                # Loaded asynchronously, as vLLM's connectors load: the request holds its blocks
                # and waits (vLLM's WAITING_FOR_REMOTE_KVS) while the others compute; its
                # prefill starts in the first step after the load.
                request.ready_at = time.monotonic() + self.cpu.load_ms(loaded) / 1000 / self.timing.speedup
        computed = (len(hit) + loaded) * size
        count = 0 if loaded else min(len(tokens) - computed, budget)
        self.pool.touch(hit)
        request.blocks = hit + self.pool.allocate(_cdiv(computed + count, size) - len(hit))
        request.num_computed = computed
        request.num_cached_blocks = len(hit)
        if request.cached_tokens is None:
            request.cached_tokens = computed
        self.stats.prefix_queries += len(tokens)
        self.stats.prefix_hits += len(hit) * size
        self._cache(request, computed + count)
        return count

    def _cache(self, request: SimRequest, num_tokens: int) -> None:
        full = num_tokens // self.pool.block_size
        tokens = request.all_tokens
        if full > len(request.hashes):
            parent = request.hashes[-1] if request.hashes else None
            request.hashes += chain_hashes(
                tokens[: full * self.pool.block_size],
                self.pool.block_size,
                request.keys,
                start=len(request.hashes),
                parent=parent,
            )
        self.pool.cache(request.blocks, request.hashes[:full], tokens, request.num_cached_blocks, request.keys)
        if self.cpu is not None:  # write through: the CPU tier copies what the GPU caches
            self.cpu.store(
                request.hashes[: min(full, len(request.blocks))], tokens, request.num_cached_blocks, request.keys
            )
        request.num_cached_blocks = max(request.num_cached_blocks, min(full, len(request.blocks)))

    def _preempt(self, request: SimRequest) -> None:
        self.pool.free(list(reversed(request.blocks)))
        request.blocks, request.num_computed, request.num_cached_blocks = [], 0, 0
        request.prefilling = False
        request.num_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(request)

    # --- after the forward pass -------------------------------------------------------------

    def complete(self, plan: StepPlan) -> None:
        """End the step ``plan`` scheduled: its tokens are computed; requests whose computed
        tokens caught up with their tokens sample their next one."""
        now = time.monotonic()
        for request, count in plan.scheduled:
            if request.finished.is_set():
                continue  # aborted during the step
            request.num_computed += count
            if request.num_computed < len(request.all_tokens):
                continue  # a prefill chunk that is not the last one
            request.prefilling = False
            token = self._next_token(request)
            request.output.append(token)
            request.token_times.append(now)
            self.stats.generation_tokens += 1
            if request.first_token_at is None:
                request.first_token_at = now
                self.stats.prompt_tokens += len(request.prompt)
                self.stats.prompt_tokens_cached += request.cached_tokens or 0
                self.stats.prompt_tokens_external += request.external_tokens
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
        request.finished_at = time.monotonic()
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
