"""Faults a simulated engine can be told to show, for the fault suite (tests/e2e/faults/).

A real engine loses KV-event messages (a subscriber's queue overflows, a network hiccup) and
serves broken /metrics (a NaN gauge, a proxy's error page); the agent must survive both. An engine
started in-process exposes its :class:`EngineFaults` as ``RunningEngine.faults``; a test changes
it while traffic runs. ``--drop-events-every`` sets the first knob for an engine process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class EngineFaults:
    # Every Nth KV-event batch (by seq) is kept for replay but never sent: the subscriber sees a
    # sequence gap, as when ZMQ drops a message. 0: every batch is sent.
    drop_events_every: int = 0
    # Rewrites the /metrics text before it is served (e.g. a gauge set to NaN, or the whole body
    # replaced by garbage); None: the real metrics.
    metrics_rewrite: Callable[[str], str] | None = None
    events_dropped: int = 0  # batches not sent because of drop_events_every
    metrics_rewritten: int = 0  # /metrics answers that went through metrics_rewrite

    def __post_init__(self) -> None:
        if self.drop_events_every < 0:
            raise ValueError(f"drop_events_every must be >= 0 (0: drop none), got {self.drop_events_every}")

    def deliver(self, seq: int) -> bool:
        """Whether the batch ``seq`` is sent (counts the ones that are not)."""
        every = self.drop_events_every
        if every and seq % every == every - 1:
            self.events_dropped += 1
            return False
        return True

    def metrics_text(self, text: str) -> str:
        if self.metrics_rewrite is None:
            return text
        self.metrics_rewritten += 1
        return self.metrics_rewrite(text)
