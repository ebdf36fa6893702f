"""The agent's Prometheus metrics. Counters live as plain integers on the agent (cheap on the hot
path) and are read by a collector at scrape time; each agent gets its own registry."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from worker_agent.translate import TranslateCounters

PREFIX = "kvroute_agent_"


@dataclass
class AgentCounters:
    batches_received: int = 0
    batches_applied: int = 0
    events_applied: int = 0
    duplicates: int = 0
    gaps: int = 0
    replays: int = 0
    replays_incomplete: int = 0
    replays_timed_out: int = 0  # answers without their end marker (idle, or at --replay-deadline)
    resyncs: int = 0  # gaps that replay could not repair: the worker was cleared and rebuilt
    decode_errors: int = 0
    dropped_messages: int = 0  # the inbox was full: each one is a sequence gap
    events_disconnects: int = 0  # the connection to the engine's publisher dropped
    unknown_events: int = 0
    unknown_keys: int = 0
    wrong_topic: int = 0
    engine_restarts: int = 0
    engine_down: int = 0
    redis_errors: int = 0
    internal_errors: int = 0
    engine_metric_errors: int = 0  # values on the engine's /metrics ignored (NaN, +Inf, text, ...)
    verifications: int = 0  # block-count checks (index vs mirror)
    heartbeats: int = 0  # heartbeats Redis accepted
    blocks_over_limit: int = 0  # stores the index refused: the worker held its engine's capacity
    split_batches: int = 0  # engine batches too large for one atomic apply call
    reasserts: Counter[str] = field(default_factory=Counter)  # by reason
    # blocks the engine stored in a way the router's hash cannot rebuild, by reason (kvevents/sglang.py)
    unreproducible_blocks: Counter[str] = field(default_factory=Counter)


@dataclass(frozen=True)
class Gauges:
    mirror_blocks: int
    mirror_indexed_blocks: int
    engine_hashes: int
    registered: bool
    engine_up: bool
    last_seq: int
    events_silent: bool = False
    last_event_timestamp_seconds: float = 0.0
    engine_start_time_seconds: float = 0.0
    queued_messages: int = 0
    queued_bytes: int = 0


_HELP = {
    "batches_received": "Engine batches received (live and replayed)",
    "batches_applied": "Engine batches applied to the index, in order",
    "events_applied": "KV events applied (stored, removed, cleared)",
    "duplicates": "Batches received twice (live after replay) and skipped",
    "gaps": "Sequence gaps detected",
    "replays": "Replay requests sent to the engine",
    "replays_incomplete": "Replays that did not return every missing batch",
    "replays_timed_out": "Replays that ended without the engine's end marker (idle, or at --replay-deadline)",
    "resyncs": "Unrepairable gaps: the worker's entries were cleared and rebuilt from new events",
    "decode_errors": "Malformed messages, counted and skipped",
    "dropped_messages": "KV-event messages dropped because the agent held too many (a gap, repaired by replay)",
    "events_disconnects": "Connections to the engine's KV-event publisher lost (engine gone, or a message too big)",
    "unknown_events": "Events of unknown types, counted and skipped",
    "unknown_keys": "Events with keys this decoder does not know",
    "wrong_topic": "Messages on another topic, skipped",
    "engine_restarts": "Engine restarts detected (seq back to 0, or /health down then up)",
    "engine_down": "Times the engine's /health failed long enough to take the worker out",
    "redis_errors": "Redis calls that failed (the mirror keeps the truth; re-assert heals)",
    "internal_errors": "Unexpected errors in the agent's loops (logged; a failed batch rebuilds the worker)",
    "engine_metric_errors": "Values on the engine's /metrics ignored: NaN, infinite, not a number or out of range",
    "verifications": "Checks of the index's block count for this worker against the mirror",
    "heartbeats": "Heartbeats Redis accepted (they run on their own schedule, beside replays and writes)",
    "blocks_over_limit": "Stored blocks not indexed: the worker already held its engine's KV capacity",
    "split_batches": "Engine batches too large for one atomic index call, written in several (readers may see part)",
}
_GAUGE_HELP = {
    "mirror_blocks": "Blocks the engine holds, as the agent's mirror knows them",
    "mirror_indexed_blocks": "Blocks of the mirror that are indexed (their whole prefix is held)",
    "engine_hashes": "Engine block hashes the agent maps to its own",
    "registered": "1 while the worker is registered in the index",
    "engine_up": "1 while the engine's /health answers",
    "last_seq": "Seq of the last engine batch applied (-1: none yet)",
    "events_silent": "1 while the engine serves requests but no KV event arrives (check --events and --topic)",
    "last_event_timestamp_seconds": "Unix time of the last KV-event message received (0: none yet)",
    "engine_start_time_seconds": "The engine's process_start_time_seconds as last read (0: unknown; a change: restart)",
}
_GAUGE_HELP["queued_messages"] = "KV-event messages received and not yet applied"
_GAUGE_HELP["queued_bytes"] = "Bytes of the KV-event messages received and not yet applied"
_TRANSLATE_HELP = {
    "blocks_stored": "Blocks stored by the engine and translated",
    "blocks_removed": "Block copies removed by the engine and translated",
    "clears": "AllBlocksCleared events",
    "orphan_runs": "Stored runs skipped because their parent block is unknown",
    "orphan_blocks": "Blocks in stored runs skipped because their parent is unknown",
    "unknown_removals": "Removed engine hashes never seen stored",
    "other_tier_events": "Events on offload tiers (CPU, STORAGE), not indexed",
    "other_group_events": "Events of KV-cache groups not indexed (a second full-attention group, a kind not known)",
    "block_size_mismatches": "Stored runs whose block size differs from the worker's, skipped",
    "unsupported_extra_keys": "Stored runs with extra keys the router cannot reproduce, skipped",
    "hash_conflicts": "Engine hashes stored again with different content",
    "window_blocks_stored": "Blocks of sliding-window and Mamba KV-cache groups indexed (hybrid models)",
    "window_blocks_removed": "Blocks of sliding-window and Mamba KV-cache groups removed from the index",
}


class AgentCollector(Collector):
    def __init__(
        self,
        counters: AgentCounters,
        translate_counters: Callable[[], TranslateCounters],
        gauges: Callable[[], Gauges],
    ) -> None:
        self._counters = counters
        self._translate = translate_counters
        self._gauges = gauges

    def collect(self) -> Iterator[Metric]:
        for name, help_text in _HELP.items():
            yield CounterMetricFamily(PREFIX + name, help_text, value=getattr(self._counters, name))
        reasserts = CounterMetricFamily(PREFIX + "reasserts", "Re-asserts of all blocks", labels=["reason"])
        for reason, count in sorted(self._counters.reasserts.items()):
            reasserts.add_metric([reason], count)
        yield reasserts
        unreproducible = CounterMetricFamily(
            PREFIX + "unreproducible_blocks",
            "Blocks the engine stored in a way the router's hash cannot rebuild (EAGLE bigrams, an unnamed "
            "LoRA), not indexed: the worker is routed by load for them",
            labels=["reason"],
        )
        for reason, count in sorted(self._counters.unreproducible_blocks.items()):
            unreproducible.add_metric([reason], count)
        yield unreproducible
        translate = self._translate()
        for item in fields(translate):
            value = getattr(translate, item.name)
            yield CounterMetricFamily(PREFIX + item.name, _TRANSLATE_HELP[item.name], value=value)
        gauges = self._gauges()
        for item in fields(gauges):
            value = float(getattr(gauges, item.name))
            yield GaugeMetricFamily(PREFIX + item.name, _GAUGE_HELP[item.name], value=value)


def new_registry() -> tuple[CollectorRegistry, Histogram]:
    """A registry for one agent and its apply-latency histogram (receive -> applied in Redis)."""
    registry = CollectorRegistry()
    latency = Histogram(
        PREFIX + "apply_latency_seconds",
        "From receiving a batch to its changes being applied in the index",
        buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
        registry=registry,
    )
    return registry, latency
