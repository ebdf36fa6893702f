"""Engine batches -> index, in order: decode, sequence, repair gaps by replay, translate, apply.

Consecutive in-order batches that arrive together are applied with one Lua call (one atomic
step: readers never see part of a batch). A gap is repaired from the engine's replay buffer;
when the missing batches are gone, the worker is cleared and rebuilt from the batches that are
still there and from new ones (a "resync"), because an index that might list evicted blocks is
worse than one that temporarily lists too few.

The pipeline owns the stream's state: the translator (engine hash -> ours, the block size) and
the sequencer (which seq comes next). The agent only ever asks it to :meth:`EventPipeline.reset`,
to learn the block size, or to catch up.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

import xxhash
from prometheus_client import Histogram

from kvevents.events import UNREPRODUCIBLE, BlockStored, Event, EventBatch, WireError
from kvindex.groups import format_groups
from kvindex.tiers import GPU, TIERS
from kvindex.types import BlockChange
from worker_agent.engine_kinds import KINDS, VLLM, EngineKind
from worker_agent.metrics import AgentCounters
from worker_agent.pages import PageBlocks
from worker_agent.replay import ReplayClient
from worker_agent.sequencer import Action, Sequencer
from worker_agent.translate import TranslateCounters, Translator
from worker_agent.writer import WorkerWriter

log = logging.getLogger(__name__)


@dataclass
class Received:
    frames: list[bytes]
    at: float = field(default_factory=time.perf_counter)


@dataclass
class _Pending:
    """Changes of in-order batches not yet written, per tier (one list per engine batch, so that
    each reaches Redis whole: ``RedisWorker.apply_batches``), with their receive times."""

    tiers: dict[str, list[list[BlockChange]]] = field(default_factory=dict)
    received_at: list[float] = field(default_factory=list)

    def add(self, tier: str, changes: list[BlockChange]) -> None:
        if changes:
            self.tiers.setdefault(tier, []).append(list(changes))


class EventPipeline:
    def __init__(
        self,
        writer: WorkerWriter,
        replay: ReplayClient | None,
        topic: str,
        counters: AgentCounters,
        latency: Histogram,
        block_size: int | None = None,
        tiers: frozenset[str] = frozenset(TIERS),
    ) -> None:
        self.writer = writer
        self._translator = Translator(block_size, tiers)
        self._sequencer = Sequencer()
        self._replay = replay
        self._topic = topic
        self._counters = counters
        self._latency = latency
        self._last_decode_log = 0.0
        self._unreproducible_said: set[str] = set()
        self.kind: EngineKind = KINDS[VLLM]
        self._pages: PageBlocks | None = None  # a paged engine's pages (set_engine_kind)
        self.last_seq = -1

    # --- state ----------------------------------------------------------------------------

    @property
    def block_size(self) -> int | None:
        """Tokens per block: from the settings, the engine's /metrics, or the first BlockStored."""
        return self._translator.block_size

    @block_size.setter
    def block_size(self, value: int | None) -> None:
        self._translator.block_size = value

    def learn_block_size(self, messages: list[Received]) -> bool:
        """Take the block size from the first BlockStored among ``messages`` unless it is known;
        True when it is known afterwards."""
        if self.block_size is not None:
            return True
        for message in messages:
            decoded = self.decode(message.frames)
            for event in decoded[0].events if decoded else ():
                if isinstance(event, BlockStored):
                    self.block_size = event.block_size
                    return True
        return False

    def set_engine_kind(self, kind: EngineKind, paged_block_size: int) -> None:
        """Read ``kind``'s dialect from now on; a paged engine's pages are re-blocked into blocks of
        the block size set (else ``paged_block_size``), which its pages never tell."""
        self.kind = kind
        if kind.paged:
            if self.block_size is None:
                self.block_size = paged_block_size
            self._pages = PageBlocks(self.block_size, self._translator.counters)

    @property
    def translate_counters(self) -> TranslateCounters:
        return self._translator.counters

    @property
    def engine_hashes(self) -> int:
        """Engine block hashes the translator maps to ours (the blocks the engine holds)."""
        return len(self._translator)

    def reset(self) -> None:
        """Forget the stream (translation map and expected seq): the engine's cache is empty, or
        this worker's entries are about to be rebuilt. Counters and the block size stay."""
        self._translator.reset()
        if self._pages is not None:
            self._pages.reset()
        self._sequencer.reset()

    def decode(self, frames: list[bytes]) -> tuple[EventBatch, int] | None:
        """The batch and its payload digest, or None (counted, logged) when it is not one."""
        try:
            batch = self.kind.decode(frames, self._topic)
        except WireError as exc:
            self._bad_message(str(exc))
            return None
        except Exception as exc:  # a decoder bug must not stop the agent either
            self._bad_message(f"{type(exc).__name__}: {exc}")
            return None
        if not batch.topic.startswith(self._topic):
            self._counters.wrong_topic += 1
            return None
        self._counters.unknown_events += batch.unknown_events
        self._counters.unknown_keys += len(batch.unknown_keys)
        if batch.unreproducible:
            self._unreproducible(batch.unreproducible)
        return batch, xxhash.xxh3_64_intdigest(frames[-1])

    def _unreproducible(self, blocks: Mapping[str, int]) -> None:
        """Count blocks the router's hash cannot rebuild, and say so once per reason."""
        self._counters.unreproducible_blocks.update(blocks)
        for reason in blocks.keys() - self._unreproducible_said:
            self._unreproducible_said.add(reason)
            log.warning(
                "the engine stores blocks the router cannot hash (%s: %s); they are not indexed, and requests "
                "are routed to this worker by its load alone for them (counted in "
                "kvroute_agent_unreproducible_blocks_total; said once)",
                reason,
                UNREPRODUCIBLE.get(reason, "a form this agent cannot rebuild"),
                extra={"fields": {"reason": reason}},
            )

    def _bad_message(self, reason: str) -> None:
        self._counters.decode_errors += 1
        now = time.monotonic()
        if now - self._last_decode_log > 5.0:
            self._last_decode_log = now
            log.warning("skipped a malformed KV-event message (%d so far): %s", self._counters.decode_errors, reason)

    # --- applying -------------------------------------------------------------------------

    async def process(self, messages: list[Received]) -> None:
        """Apply live messages in order (the caller holds the agent's lock)."""
        pending = _Pending()
        for message in messages:
            self._counters.batches_received += 1
            decoded = self.decode(message.frames)
            if decoded is None:
                continue
            batch, digest = decoded
            decision = self._sequencer.classify(batch.seq, digest)
            if decision.action is Action.DUPLICATE:
                self._counters.duplicates += 1
                continue
            if decision.action is not Action.APPLY:
                await self._flush(pending)
                if decision.action is Action.RESTART:
                    await self.engine_restarted(f"seq went back from {self._sequencer.expected} to {batch.seq}")
                    decision = self._sequencer.classify(batch.seq, digest)
                if decision.action is Action.GAP:
                    self._counters.gaps += 1
                    log.info("seq gap: expected %d, got %d", decision.missing_from, batch.seq)
                    await self._repair(decision.missing_from, batch.seq)
            await self._accept(batch, digest, message.at, pending)
        await self._flush(pending)

    async def engine_restarted(self, why: str) -> None:
        """A new engine process: its cache starts empty."""
        self._counters.engine_restarts += 1
        log.warning("engine restarted (%s): clearing this worker's entries", why)
        await self.reset_worker()

    async def reset_worker(self) -> None:
        """Start over: forget the stream and clear this worker's entries."""
        self.reset()
        await self.writer.clear()

    async def repair_drops(self) -> None:
        """Messages after the last one applied were dropped before reaching the pipeline: fetch
        everything from the next seq on (later live copies are duplicates), or resync."""
        if self._sequencer.expected is None:
            return  # nothing applied yet: the next message's seq shows what is missing
        self._counters.gaps += 1
        log.info("messages were dropped after seq %d: repairing from the replay buffer", self.last_seq)
        await self._repair(self._sequencer.expected, None)

    async def catch_up(self) -> None:
        """On (re)registration (the worker is empty): forget the old stream and rebuild from every
        batch the engine still buffers."""
        self.reset()
        if self._replay is not None:
            await self._repair(0, None)

    async def _accept(self, batch: EventBatch, digest: int, received_at: float, pending: _Pending) -> None:
        if self._pages is not None:
            events: Sequence[Event] = self._pages.translate(batch.events)
        else:  # only a paged engine's events move blocks between tiers (kvevents/trtllm.py)
            events = cast(Sequence[Event], batch.events)
        translated = self._translator.translate(events)
        if translated.clear:
            pending.tiers.clear()  # the clear wipes them anyway
            await self._flush(pending)
            await self.writer.clear()
        pending.add(GPU, translated.changes)
        for tier, changes in translated.lower.items():
            pending.add(tier, changes)
        pending.received_at.append(received_at)
        self._sequencer.applied(batch.seq, digest)
        self.last_seq = batch.seq
        self._counters.batches_applied += 1
        self._counters.events_applied += len(batch.events)

    async def _flush(self, pending: _Pending) -> None:
        # a hybrid model's groups, named by its first events
        await self.writer.note_kv_groups(format_groups(self._translator.groups.values()))
        if pending.tiers:
            await self.writer.apply_tiers(pending.tiers)
        now = time.perf_counter()
        for received_at in pending.received_at:
            self._latency.observe(now - received_at)
        pending.tiers, pending.received_at = {}, []

    async def _repair(self, start: int, until: int | None) -> None:
        """Apply batches [start, until) (until None: all there are) from the replay buffer."""
        if self._replay is None:
            await self._resync(f"batches {start}..{until} are missing and there is no replay endpoint")
            return
        self._counters.replays += 1
        result = await self._replay.fetch(start)
        self._counters.replays_timed_out += not result.complete
        received_at = time.perf_counter()
        batches: list[tuple[EventBatch, int]] = []
        for frames in result.messages:
            decoded = self.decode(frames)
            if decoded is not None and decoded[0].seq >= start and (until is None or decoded[0].seq < until):
                batches.append(decoded)
        run = _contiguous_tail(batches)
        run_end = run[-1][0].seq + 1 if run else start
        if until is not None and run_end != until:
            run = []  # the batches just before `until` are missing too: applying older ones would skip removals
        repaired = run[0][0].seq == start if run else until is None
        if not repaired:
            self._counters.replays_incomplete += 1
            first = run[0][0].seq if run else "none"
            await self._resync(f"needed seq {start}..{until}, the replay returned from {first}")
        pending = _Pending()
        for batch, digest in run:
            await self._accept(batch, digest, received_at, pending)
        await self._flush(pending)

    async def _resync(self, why: str) -> None:
        self._counters.resyncs += 1
        log.warning("cannot repair the event stream (%s): rebuilding this worker's entries from new events", why)
        had_state = self.engine_hashes > 0
        self.reset()
        if had_state:
            await self.writer.clear()


def _contiguous_tail(batches: list[tuple[EventBatch, int]]) -> list[tuple[EventBatch, int]]:
    """The longest run of consecutive seqs that ends with the last batch (duplicates dropped)."""
    tail: list[tuple[EventBatch, int]] = []
    for item in batches:
        if tail and item[0].seq <= tail[-1][0].seq:
            continue
        if tail and item[0].seq != tail[-1][0].seq + 1:
            tail = []
        tail.append(item)
    return tail
