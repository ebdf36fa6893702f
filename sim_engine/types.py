"""The simulated engine's data: its timing model and limits, a request, a step's plan, its counters.

:mod:`sim_engine.engine` re-exports them (``from sim_engine.engine import TimingModel`` keeps working).
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvservice.declared import Kind, of_type, setting
from sim_engine.block_pool import Block, CacheKeys

# vLLM 0.32's default for its OpenAI server on GPUs under 70 GiB and on CPUs (H100/H200: 8192;
# 160 GiB and more: 16384); docs/sim-engine.md says more.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_MAX_NUM_SEQS = 64  # this engine's batch limit before it had vLLM's name (vLLM: 256 on GPUs)


@dataclass(frozen=True, init=False)
class TimingModel:
    """The scheduler's limits and the step time model.

    ``max_num_seqs`` is vLLM's name for the batch limit; ``max_running`` (keyword and attribute)
    is the same setting under its older name here."""

    VARIABLE_PREFIX: ClassVar[str] = "KVROUTE_SIM_"  # its settings' variables (kvservice.declared)

    prefill_ms_per_1k_tokens: float = setting(
        100.0, flag="--prefill-ms-per-1k-tokens", parse=of_type(float), help="prefill ms per 1k uncached tokens"
    )
    decode_ms_per_step: float = setting(
        20.0, flag="--decode-ms-per-step", parse=of_type(float), help="the time of a step that decodes"
    )
    step_overhead_ms: float = setting(1.0, flag="--step-overhead-ms", parse=of_type(float), help="fixed time per step")
    max_num_seqs: int = setting(
        DEFAULT_MAX_NUM_SEQS,
        flag="--max-num-seqs",
        aliases=("--max-running",),
        parse=of_type(int),
        help="vLLM's batch limit: requests running at once, more wait; at most --max-num-batched-tokens (vLLM's "
        "rule) unless that is 0 (--max-running: the same, its older name)",
    )
    speedup: float = setting(
        1.0,
        flag="--speedup",
        parse=of_type(float),
        help="run this many times faster than real time: every duration divided by it",
    )
    max_num_batched_tokens: int = setting(
        DEFAULT_MAX_NUM_BATCHED_TOKENS,
        flag="--max-num-batched-tokens",
        parse=of_type(int),
        help="tokens one engine step may schedule, shared by decodes and prefill chunks (chunked prefill, as vLLM; "
        "the default is vLLM's for an online server; 0: no budget)",
    )
    decode_ms_per_token: float = setting(
        0.0,
        flag="--decode-ms-per-token",
        parse=of_type(float),
        help="added per decoding request in a step: large batches decode slower",
    )
    # Attention grows with the context: a chunk of N new tokens after P computed ones costs
    # this many ns x N x (P + N / 2) more (0: prefill time linear in new tokens alone).
    prefill_context_ns: float = setting(
        0.0,
        flag="--prefill-context-ns",
        parse=of_type(float),
        help="attention's share of prefill: a chunk of N new tokens after P computed ones takes this many ns x N x "
        "(P + N/2) more (an H200 with Llama-3.1-8B in bf16 measured 2.0 beside 18.5 us per token)",
    )
    # Each request's prefill in its own lane: the token budget is per request, and a step takes
    # as long as its longest prefill chunk, not their sum (an engine far from saturating its GPU).
    parallel_prefill: bool = setting(
        False,
        flag="--parallel-prefill",
        kind=Kind.SWITCH,
        help="each request's prefill in its own lane: the token budget is per request and a step takes its longest "
        "chunk's time, not their sum (an engine whose prefills do not queue behind each other)",
    )

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


# Where a decode leg's pull of its prompt's KV from the prefill engine stands (sim_engine/kv_transfer.py).
UNREAD = "unread"  # not admitted yet (vLLM: do_remote_prefill still true)
PULLING = "pulling"  # admitted, holding its blocks, waiting for the KV (vLLM's WAITING_FOR_REMOTE_KVS)
PULLED = "pulled"
FAILED = "failed"  # the prefill engine was gone or no longer held the blocks


@dataclass
class RemotePrefill:
    """A decode leg's ``kv_transfer_params`` (``do_remote_prefill``): where its prompt's KV is,
    as vLLM's NIXL connector names it in the prefill engine's reply."""

    engine_id: str
    request_id: str  # the prefill engine's request holding the blocks
    block_ids: list[int]  # its blocks, in prompt order (the full-attention group's)
    host: str  # the prefill engine's HTTP address here (NIXL's side channel in vLLM)
    port: int
    prefill_cached_tokens: int | None = None  # vLLM's remote_prefill_cached_tokens: the reply's cached tokens
    state: str = UNREAD
    error: str = ""  # why the pull failed (logged; the client gets vLLM's bare 500)


@dataclass(eq=False)
class SimRequest:
    request_id: str
    prompt: list[int]
    max_tokens: int
    keys: CacheKeys = field(default_factory=CacheKeys)  # its cache_salt and LoRA adapter
    output: list[int] = field(default_factory=list)
    blocks: list[Block] = field(default_factory=list)  # its full-attention group's block table
    hashes: list[int] = field(default_factory=list)  # full blocks of prompt + output
    num_computed: int = 0  # tokens whose KV is computed (after the step that scheduled them)
    num_cached_blocks: int = 0
    # A hybrid model's sliding-window group (sim_engine/hybrid.py): its block table (the null block
    # where blocks slid out of the window), how many of its blocks went through caching, and the
    # shared-prefix junction found with the hit (vLLM's shared_prefix_boundary; 0: none).
    window_blocks: list[Block] = field(default_factory=list)
    num_window_cached: int = 0
    shared_prefix: int = 0
    cached_tokens: int | None = None  # the prefix hit when first scheduled (loaded from the lower tiers too)
    external_tokens: int = 0  # of those, the ones loaded from the CPU or disk tier or pulled from a prefill engine
    ready_at: float = 0.0  # monotonic time its load from the lower tiers ends: computed from then on
    prefilling: bool = False  # admitted, and its computed tokens have not caught up with its tokens yet
    num_preemptions: int = 0
    arrived: float = field(default_factory=time.monotonic)
    scheduled_at: float | None = None  # first scheduled (vLLM's scheduled_ts: preemptions do not move it)
    first_token_at: float | None = None
    token_times: list[float] = field(default_factory=list)  # when each output token was sampled
    finished_at: float | None = None
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    tokens: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)  # None: finished
    # Prefill/decode disaggregation (sim_engine/kv_transfer.py): a prefill leg keeps its blocks for
    # a remote decode (do_remote_decode) and its reply names them (kv_transfer_out); a decode leg
    # pulls its prompt's KV from the prefill engine (remote).
    remote_decode: bool = False
    kv_transfer_out: dict[str, Any] | None = None
    remote: RemotePrefill | None = None
    failed: bool = False  # finished with an error (vLLM's FINISHED_ERROR: a KV load that failed)

    @property
    def all_tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def reported_cached_tokens(self) -> int:
        """The reply's ``prompt_tokens_details.cached_tokens``: the prefix hit when first scheduled;
        a decode leg reports the prefill engine's hit its parameters carry (vLLM's output processor
        takes ``remote_prefill_cached_tokens``), not the KV it pulled."""
        if self.remote is not None and self.remote.prefill_cached_tokens is not None:
            return self.remote.prefill_cached_tokens
        return self.cached_tokens or 0


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

    def add(self, request: SimRequest, count: int, timing: TimingModel) -> int:
        """Schedule ``count`` tokens of ``request`` in this step; what they take from the step's
        token budget (nothing with parallel prefill, where the budget is each request's own)."""
        self.scheduled.append((request, count))
        if request.prefilling:
            self.prefill_tokens += count
            chunk = timing.chunk_ms(count, request.num_computed)
            self.prefill_ms = max(self.prefill_ms, chunk) if timing.parallel_prefill else self.prefill_ms + chunk
        else:
            self.decodes += 1
        return 0 if timing.parallel_prefill else count

    def tokens_of(self, request: SimRequest) -> int:
        return next((n for r, n in self.scheduled if r is request), 0)


@dataclass
class EngineStats:
    prompt_tokens: int = 0  # counted when the request's first token comes, as vLLM
    prompt_tokens_cached: int = 0  # of those, the prefix-cache hits when first scheduled
    prompt_tokens_external: int = 0  # of those, loaded from the CPU or disk tier or pulled from a prefill engine
    generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    preemptions: int = 0
    requests_finished: int = 0
    steps: int = 0


def cdiv(a: int, b: int) -> int:
    """a / b rounded up (blocks for a number of tokens)."""
    return -(-a // b)
