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
as vLLM's ``allocate_slots`` does; which blocks a request holds and caches is its KV-cache
manager's (sim_engine/kv_cache.py: one full-attention group; sim_engine/hybrid.py: a sliding-window
group beside it, with ``sliding_window``). A request samples its next token in the step that computes its
last token (its first token: the step of its last prompt chunk). The step's KV events are
published at schedule time, before the "forward pass", which takes

    step_overhead + prefill tokens x prefill_per_token
      + (decodes ? decode_step + decodes x decode_per_token : 0)

divided by ``speedup``, where a chunk of N new tokens after P computed ones costs
``N x prefill_per_token + prefill_context_ns x N x (P + N / 2)`` (attention over the context).
With ``parallel_prefill`` each request has its own token budget and the step takes its longest
chunk's time instead of their sum. Output tokens are pseudo-random (the KV cache is what is simulated).

With a KV connector (sim_engine/kv_transfer.py, prefill/decode disaggregation) a prefill leg keeps
its blocks when it finishes, for the decode engine to pull; a decode leg is admitted with its local
hit, holds the blocks of its whole prompt and waits in ``loading`` (vLLM's WAITING_FOR_REMOTE_KVS,
counted as waiting) while the rest is pulled; the pulled blocks are cached when they arrive, and
its last prompt token is computed in the step that schedules it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from sim_engine.block_pool import BlockPool, CacheKeys, chain_hashes
from sim_engine.decode_legs import DecodeLegs
from sim_engine.faults import EngineFaults
from sim_engine.hybrid import HybridKVCacheManager, hybrid_groups
from sim_engine.kv_cache import KVCacheManager
from sim_engine.kv_events import EventSink
from sim_engine.offload import CPU, DISK, LowerTiers
from sim_engine.shared_compute import SharedCompute
from sim_engine.types import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    PULLING,
    UNREAD,
    EngineStats,
    RequestRejected,
    SimRequest,
    StepPlan,
    TimingModel,
)

if TYPE_CHECKING:
    from sim_engine.kv_transfer import KVConnector

__all__ = [  # the types live in sim_engine/types.py; importing them from here keeps working
    "DEFAULT_MAX_NUM_BATCHED_TOKENS",
    "DEFAULT_MAX_NUM_SEQS",
    "EngineStats",
    "RequestRejected",
    "SimEngine",
    "SimRequest",
    "StepPlan",
    "TimingModel",
]

FIRST_ORDINARY_TOKEN = 5  # below: <unk>, <s>, </s> and the chat markers of the tiny model


class SimEngine(DecodeLegs):
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        timing: TimingModel,
        publisher: EventSink | None = None,
        max_model_len: int = 4096,
        vocab_size: int = 2048,
        on_step: Callable[[StepPlan], None] | None = None,
        faults: EngineFaults | None = None,
        cpu_blocks: int = 0,
        cpu_load_ms_per_1k_tokens: float = 4.0,
        sliding_window: int = 0,
        connector: KVConnector | None = None,
        disk_blocks: int = 0,
        disk_load_ms_per_1k_tokens: float = 30.0,
        compute: SharedCompute | None = None,
    ) -> None:
        if sliding_window and (cpu_blocks or disk_blocks):
            raise ValueError("a sliding window (a hybrid KV cache) and a CPU or disk tier cannot be combined")
        if connector is not None and (sliding_window or cpu_blocks or disk_blocks):
            raise ValueError("a KV connector is simulated for one full-attention group without a CPU or disk tier")
        self.kv = self._cache_manager(num_blocks, block_size, sliding_window, timing, max_model_len)
        self.compute = compute  # shared with other engines (sim_engine/shared_compute.py); None: its own
        self.pool = self.kv.pool
        # the lower tiers behind the GPU cache in load order (sim_engine/offload.py), their events with the pool's
        cpu, disk = (cpu_blocks, cpu_load_ms_per_1k_tokens), (disk_blocks, disk_load_ms_per_1k_tokens)
        self.tiers = LowerTiers.build(block_size, self.pool.emit, cpu, disk)
        self.cpu, self.disk = self.tiers.of(CPU), self.tiers.of(DISK)
        self.faults = faults or EngineFaults()
        self.timing = timing
        self.publisher = publisher
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.on_step = on_step  # called with each step's plan when it is scheduled (metrics)
        self.stats = EngineStats()
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.loading: list[SimRequest] = []  # decode legs pulling their KV (vLLM's kv_holding_waiting)
        self.connector = connector  # prefill/decode disaggregation (sim_engine/kv_transfer.py)
        if connector is not None:
            connector.attach(self)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @staticmethod
    def _cache_manager(
        num_blocks: int, block_size: int, sliding_window: int, timing: TimingModel, max_model_len: int
    ) -> KVCacheManager:
        """One full-attention group, or with ``sliding_window`` a hybrid model's two groups
        sharing the ``num_blocks`` blocks (sim_engine/hybrid.py)."""
        if not sliding_window:
            return KVCacheManager(BlockPool(num_blocks, block_size))
        pool = BlockPool(num_blocks, block_size, hybrid_groups(sliding_window))
        # a step's tokens in flight: its budget (no budget: a whole prompt, at most the model's length)
        in_flight = timing.max_num_batched_tokens or max_model_len
        return HybridKVCacheManager(pool, sliding_window, in_flight, max_model_len)

    def start(self) -> SimEngine:
        self._task = asyncio.create_task(self._loop())
        return self

    @property
    def num_waiting(self) -> int:
        """vLLM's num_requests_waiting: the queue and the decode legs waiting for their KV."""
        return len(self.waiting) + len(self.loading)

    def wake(self) -> None:
        """Something changed outside a step (a pull ended): run the loop if it idles."""
        self._wake.set()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def submit(self, request: SimRequest) -> SimRequest:
        problem = self._problem(request)
        if problem is not None:
            if request.remote is not None and self.connector is not None:
                self.connector.abandon(request.remote)  # vLLM frees a refused decode leg's remote blocks
            raise RequestRejected(problem)
        self.waiting.append(request)
        self._wake.set()
        return request

    def _problem(self, request: SimRequest) -> str | None:
        """Why the engine cannot serve ``request`` (None: it can)."""
        total = len(request.prompt) + request.max_tokens
        if not request.prompt:
            return "the prompt is empty"
        if total > self.max_model_len:
            return (
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{total} tokens ({len(request.prompt)} in the prompt, {request.max_tokens} in the completion)."
            )
        if self.kv.max_blocks(total) > self.pool.num_blocks - 1:
            return f"the request needs more KV blocks than the cache has ({self.pool.num_blocks - 1})"
        return None

    def reset_prefix_cache(self) -> bool:
        if not self.pool.reset_prefix_cache():
            return False
        self.tiers.clear()
        return True

    def cached_prefix_tokens(self, prompt: list[int], keys: CacheKeys | None = None) -> int:
        """The prefix-cache hit ``prompt`` would get if it were scheduled now, in tokens (what an
        oracle router asks: ``POST /debug/match``)."""
        size = self.pool.block_size
        hashes = chain_hashes(prompt, size, keys or CacheKeys())
        hit = self.kv.find_hit(hashes, len(prompt)).tokens // size
        hit += sum(self.tiers.runs(hashes, hit, (len(prompt) - 1) // size - hit, touch=False))
        return hit * size

    async def _loop(self) -> None:
        while True:
            if not self.running and not self.waiting and all(remote.state == PULLING for _, remote in self._loading()):
                self._wake.clear()
                await self._wake.wait()
            plan = self.schedule()
            events = self.pool.take_events()
            if events and self.publisher is not None:
                await self.publisher.publish(events, deliver=self.faults.deliver(self.publisher.next_seq))
            seconds = self.timing.step_seconds(plan.prefill_tokens, plan.decodes, plan.prefill_ms)
            await (self.compute.compute(seconds) if self.compute else asyncio.sleep(seconds))
            self.complete(plan)

    # --- scheduling ----------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Schedule one step (its KV events wait in ``pool.events``); :meth:`complete` ends it."""
        plan = StepPlan()
        self._settle_loads()
        budget = self._schedule_running(plan, self.timing.token_budget)
        if not plan.preempted:
            budget = self._schedule_loaded(plan, budget)
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
            if request.ready_at > now:  # its KV is still loading from the lower tiers
                index += 1
                continue
            count = min(len(request.all_tokens) - request.num_computed, budget)
            end = request.num_computed + count
            self.kv.remove_skipped(request)  # before counting, as allocate_slots
            if not self._make_room(self.kv.needed(request, end), request, plan):
                break  # the request itself was preempted: it was the last one
            self.kv.grow(request, end)
            self._cache(request, end)
            budget -= plan.add(request, count, self.timing)
            index += 1
        return budget

    def _schedule_waiting(self, plan: StepPlan, budget: int) -> None:
        now = time.monotonic()
        while self.waiting and budget > 0 and len(self.running) < self.timing.max_num_seqs:
            request = self.waiting[0]
            if request.remote is not None and request.remote.state == UNREAD:
                if not self._admit_remote(request):
                    break
                self.loading.append(self.waiting.popleft())
                continue
            count = self._admit(request, budget)
            if count is None:
                break  # first come, first served: nobody overtakes a request that does not fit
            self.waiting.popleft()
            request.prefilling = True
            if request.scheduled_at is None:
                request.scheduled_at = now
            self.running.append(request)
            budget -= plan.add(request, count, self.timing)

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
        hit = self.kv.find_hit(request.hashes, len(tokens))
        if not self.kv.fits(hit, len(tokens), hit.tokens + min(len(tokens) - hit.tokens, budget)):
            return None
        # past the GPU's hit, what the CPU, then the disk hold is loaded (as much as vLLM counts)
        held = len(hit.full)
        loaded = self.tiers.admit(request, held, (len(tokens) - 1) // size - held, self.timing.speedup)
        computed = hit.tokens + loaded * size
        count = 0 if loaded else min(len(tokens) - computed, budget)
        self.kv.take(request, hit, computed + count)
        request.num_computed = computed
        if request.cached_tokens is None:
            request.cached_tokens = computed
        self.stats.prefix_queries += len(tokens)
        self.stats.prefix_hits += hit.tokens
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
        start = request.num_cached_blocks
        self.kv.cache(request, num_tokens)
        if self.tiers:  # write through: the lower tiers copy what the GPU caches
            self.tiers.store(request.hashes[: min(full, len(request.blocks))], tokens, start, request.keys)

    def _preempt(self, request: SimRequest) -> None:
        self.kv.free(request)
        request.num_computed = 0
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
                self._finish(request, length=True)

    def _next_token(self, request: SimRequest) -> int:
        rng = random.Random(f"{request.request_id}:{len(request.output)}")
        return rng.randrange(FIRST_ORDINARY_TOKEN, self.vocab_size)

    def _finish(self, request: SimRequest, length: bool = False) -> None:
        self.running.remove(request)
        if length and request.remote_decode and self.connector is not None:
            # vLLM's NIXL request_finished: a prefill leg's blocks stay for the decode engine to read
            request.kv_transfer_out = self.connector.hold(request)
        else:
            self.kv.free(request)
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
            if request.remote is not None and self.connector is not None:
                self.connector.abandon(request.remote)  # never read: the prefill engine frees its blocks
        elif request in self.loading:
            request.finished.set()  # its blocks are freed when the pull ends (vLLM's delay_free_blocks)
