"""Ordering of engine batches: what to do with each ``seq`` that arrives (pure, no I/O).

vLLM numbers batches 0, 1, 2, ... per engine process. A jump forward is a gap (ZMQ PUB drops when
a subscriber falls behind, or the agent started late); a step back is either a batch the agent
already applied (it arrives live after the same batch came through replay) or a new engine
process counting from 0 again. The two are told apart by the payload: a recently applied seq with
the same payload digest is a duplicate, anything else is a restart.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum

RECENT_BATCHES = 20_000  # more than vLLM's default replay buffer (10,000 batches)


class Action(Enum):
    APPLY = "apply"  # the next batch in order
    GAP = "gap"  # batches [missing_from, seq) are missing: replay them first
    DUPLICATE = "duplicate"  # already applied: skip
    RESTART = "restart"  # a new engine process: its cache is empty


@dataclass(frozen=True)
class Decision:
    action: Action
    missing_from: int = 0


class Sequencer:
    def __init__(self, recent: int = RECENT_BATCHES) -> None:
        self.expected: int | None = None  # the next seq in order; None before the first batch
        self._recent: OrderedDict[int, int] = OrderedDict()
        self._recent_max = recent

    def classify(self, seq: int, digest: int) -> Decision:
        if self.expected is None:
            return Decision(Action.APPLY) if seq == 0 else Decision(Action.GAP, 0)
        if seq == self.expected:
            return Decision(Action.APPLY)
        if seq > self.expected:
            return Decision(Action.GAP, self.expected)
        if self._recent.get(seq) == digest:
            return Decision(Action.DUPLICATE)
        return Decision(Action.RESTART)

    def applied(self, seq: int, digest: int) -> None:
        self.expected = seq + 1
        self._recent[seq] = digest
        self._recent.move_to_end(seq)
        while len(self._recent) > self._recent_max:
            self._recent.popitem(last=False)

    def reset(self) -> None:
        """Forget everything: a new engine process, or the worker left the index."""
        self.expected = None
        self._recent.clear()
