"""KV-event messages received and not yet applied, bounded by count and by bytes.

A reader task drains the SUB socket into the inbox as fast as messages arrive, so that what the
agent holds is counted here rather than in ZMQ's queue (which counts messages, not bytes). When
Redis is slow or a replay holds the event stream, messages wait here; when the inbox is full, a
new message is dropped, counted and logged. A dropped message is a sequence gap like one ZMQ
drops, repaired from the engine's replay buffer or, failing that, by clearing and rebuilding the
worker (never over-crediting it). Unlike a ZMQ drop, the agent knows of it: :attr:`Inbox.lost`
says so, and once the inbox is empty the agent repairs at once rather than wait for a later
message to show the gap (the dropped ones may have been the last for a while).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable

import zmq
import zmq.asyncio

from worker_agent.metrics import AgentCounters
from worker_agent.pipeline import Received

log = logging.getLogger(__name__)
DRAIN_PER_TURN = 512  # messages taken off the socket before letting the applier run


class Inbox:
    def __init__(self, max_messages: int, max_bytes: int, counters: AgentCounters) -> None:
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        self.bytes = 0
        self.lost = False  # a message was dropped since the agent last repaired
        self._counters = counters
        self._items: deque[tuple[Received, int]] = deque()
        self._ready = asyncio.Event()
        self._last_drop_log = 0.0
        self._dropped_at_log = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, frames: list[bytes]) -> bool:
        """Hold a message; False (counted, logged at most every 5 s) when the inbox is full."""
        size = sum(len(frame) for frame in frames)
        if len(self._items) >= self.max_messages or self.bytes + size > self.max_bytes:
            self._drop()
            return False
        self._items.append((Received(frames), size))
        self.bytes += size
        self._ready.set()
        return True

    def _drop(self) -> None:
        self.lost = True
        self._counters.dropped_messages += 1
        dropped = self._counters.dropped_messages
        now = time.monotonic()
        if now - self._last_drop_log > 5.0:
            log.warning(
                "dropped %d KV-event message(s): %d messages and %d bytes are waiting to be applied "
                "(--max-queued-messages %d, --max-queued-bytes %d); the gap is repaired from the replay buffer",
                dropped - self._dropped_at_log,
                len(self._items),
                self.bytes,
                self.max_messages,
                self.max_bytes,
            )
            self._last_drop_log, self._dropped_at_log = now, dropped

    async def take(self, limit: int) -> list[Received]:
        """The oldest messages (at least one, at most ``limit``), waiting for one if need be."""
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        taken: list[Received] = []
        while self._items and len(taken) < limit:
            message, size = self._items.popleft()
            self.bytes -= size
            taken.append(message)
        return taken

    async def fill_from(self, socket: zmq.asyncio.Socket, on_message: Callable[[], None]) -> None:
        """Forever: move every message arriving on ``socket`` into the inbox (or drop it)."""
        while True:
            self.put(await socket.recv_multipart())
            for _ in range(DRAIN_PER_TURN - 1):
                try:
                    self.put(await socket.recv_multipart(flags=zmq.NOBLOCK))
                except zmq.Again:
                    break
            on_message()
            await asyncio.sleep(0)  # a flood must not starve the applier
