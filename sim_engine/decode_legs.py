"""The scheduler's side of a decode leg (prefill/decode disaggregation), as vLLM 0.32's scheduler
runs it with the NIXL connector (vllm/v1/core/sched/scheduler.py, nixl/pull_scheduler.py); mixed
into :class:`sim_engine.engine.SimEngine`. The pull itself is sim_engine/kv_transfer.py's.

* Admission (``get_num_new_matched_tokens``): the local prefix-cache hit first, then the rest of
  the prompt, to its last token, is the connector's to load asynchronously. The request takes the
  blocks of its whole prompt (uncached: ``delay_cache_blocks``), computes nothing, and waits in
  ``loading`` (vLLM's ``kv_holding_waiting`` queue, status WAITING_FOR_REMOTE_KVS): counted as
  waiting, not running, not preemptible, taking no token budget while the others run.
* Its KV arrived (``_update_waiting_for_remote_kv``): before the waiting queue, its blocks are
  cached (one BlockStored for the pulled full blocks, from this engine) and its computed tokens
  set back by one: the last prompt token is computed for its logits in this step, which samples
  the first token.
* Its pull failed: with vLLM's default ``kv_load_failure_policy`` "fail" the request finishes with
  an error (FINISHED_ERROR) and its blocks are freed, uncached; the server answers vLLM's 500.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

from sim_engine.block_pool import BlockPool, chain_hashes
from sim_engine.kv_cache import KVCacheManager
from sim_engine.types import FAILED, PULLING, EngineStats, RemotePrefill, SimRequest, StepPlan, TimingModel

if TYPE_CHECKING:
    from sim_engine.kv_transfer import KVConnector


class DecodeLegs:
    # the engine's (sim_engine/engine.py)
    kv: KVCacheManager
    pool: BlockPool
    stats: EngineStats
    timing: TimingModel
    waiting: deque[SimRequest]
    running: list[SimRequest]
    loading: list[SimRequest]
    connector: KVConnector | None

    def _loading(self) -> list[tuple[SimRequest, RemotePrefill]]:
        return [(r, r.remote) for r in self.loading if r.remote is not None]

    def _settle_loads(self) -> None:
        """End the pulls that will not compute: failed ones end their requests with an error (vLLM's
        "fail" policy), aborted ones free their blocks once their pull is over (vLLM frees a
        loading request's blocks when its transfer ends: the connector writes into them)."""
        for request, remote in self._loading():
            if remote.state == PULLING or (remote.state != FAILED and not request.finished.is_set()):
                continue
            self.loading.remove(request)
            self.kv.free(request)
            if not request.finished.is_set():
                request.failed = True
                request.finished_at = time.monotonic()
                request.tokens.put_nowait(None)
                request.finished.set()

    def _schedule_loaded(self, plan: StepPlan, budget: int) -> int:
        """Decode legs whose KV arrived, in arrival order, before the waiting queue (vLLM drains its
        kv_holding_waiting queue first) and under the same limits; the budget left."""
        now = time.monotonic()
        for request, remote in self._loading():
            if budget <= 0 or len(self.running) >= self.timing.max_num_seqs:
                break
            if remote.state == PULLING:
                continue
            self.loading.remove(request)
            # no lower tier with a connector: caching is the KV-cache manager's alone
            self.kv.cache(request, len(request.prompt))
            request.num_computed = len(request.prompt) - 1
            request.prefilling = True
            request.scheduled_at = now  # vLLM records SCHEDULED when it runs, after its load
            self.running.append(request)
            budget -= plan.add(request, 1, self.timing)
        return budget

    def _admit_remote(self, request: SimRequest) -> bool:
        """Admit a decode leg if its whole prompt fits in the free blocks, and start its pull."""
        assert self.connector is not None
        tokens = request.prompt
        request.hashes = chain_hashes(tokens, self.pool.block_size, request.keys)
        hit = self.kv.find_hit(request.hashes, len(tokens))
        if not self.kv.fits(hit, len(tokens), len(tokens)):
            return False
        self.kv.take(request, hit, len(tokens))
        # vLLM counts local + external tokens as cached (its prefill stats and metrics); the reply's
        # usage says the prefill engine's hit instead (SimRequest.reported_cached_tokens)
        request.num_computed = request.cached_tokens = len(tokens)
        request.external_tokens = len(tokens) - hit.tokens
        self.stats.prefix_queries += len(tokens)
        self.stats.prefix_hits += hit.tokens
        self.connector.pull(request, len(hit.full), request.external_tokens)
        return True
