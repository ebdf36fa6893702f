"""Fetching KV events from an engine that hands them out over HTTP: TensorRT-LLM's trtllm-serve
drains its event queue on ``POST /kv_cache_events`` (kvevents/trtllm.py says what comes back).

Every ``interval_s`` the poller fetches what is queued and puts each event into the agent's inbox
as one message ``[b"trtllm", event_id (8 bytes), its JSON]``, so the pipeline orders, applies and
repairs them as it does ZMQ messages (a lost event is a gap; with no replay the worker is rebuilt).
Only one consumer may poll an engine: what one fetches, another never sees. For the same reason
an answer is read whole, and waited for long (60 s): the engine drained its queue when it
answered, so an answer cut short or given up on is events lost (a gap: the worker is rebuilt).

An answer that is not a JSON list, or an event without an integer ``event_id``, is counted as a
decode error and logged at most every 5 s; an engine that does not answer is retried at the next
interval.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable

import aiohttp

from kvevents.trtllm import TOPIC
from worker_agent.inbox import Inbox
from worker_agent.metrics import AgentCounters

log = logging.getLogger(__name__)
_U64 = (1 << 64) - 1


class EventPoller:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        url: str,
        counters: AgentCounters,
        interval_s: float = 0.1,
        max_bytes: int = 16 << 20,
        timeout_s: float = 60.0,
    ) -> None:
        self.url = url
        self._session = session
        self._counters = counters
        self._interval_s = interval_s
        self._max_bytes = max_bytes
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._last_log = 0.0

    async def fill(self, inbox: Inbox, on_message: Callable[[], None]) -> None:
        """Forever: move the engine's queued events into ``inbox``."""
        while True:
            events = await self.fetch()
            for event in events:
                frames = self._frames(event)
                if frames is not None:
                    inbox.put(frames)
            if events:
                on_message()
            await asyncio.sleep(self._interval_s)

    async def fetch(self) -> list[object]:
        """The events queued now (none when the engine does not answer with a list)."""
        try:
            async with self._session.post(self.url, timeout=self._timeout) as response:
                if response.status != 200:
                    self._say(f"POST {self.url} answered {response.status}")
                    return []
                body = bytearray()  # the whole answer: a read(n) returns what has arrived so far
                async for chunk in response.content.iter_any():
                    body += chunk
                    if len(body) > self._max_bytes:
                        break
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            self._say(f"POST {self.url} failed: {type(exc).__name__}")
            return []
        try:
            if len(body) > self._max_bytes:
                raise ValueError(f"over --max-message-bytes ({self._max_bytes})")
            events = json.loads(body)
            if not isinstance(events, list):
                raise ValueError(f"a JSON list was expected, got {type(events).__name__}")
        except (ValueError, RecursionError) as exc:
            self._bad(f"the engine's events are not a JSON list: {exc}"[:200])
            return []
        return events

    def _frames(self, event: object) -> list[bytes] | None:
        event_id = event.get("event_id") if isinstance(event, dict) else None
        if not isinstance(event_id, int) or isinstance(event_id, bool) or not 0 <= event_id <= _U64:
            self._bad(f"an event without an integer event_id: {json.dumps(event)[:120]}")
            return None
        return [TOPIC.encode(), event_id.to_bytes(8, "big"), json.dumps(event).encode()]

    def _bad(self, reason: str) -> None:
        self._counters.decode_errors += 1
        self._say(reason)

    def _say(self, reason: str) -> None:
        now = time.monotonic()
        if now - self._last_log > 5.0:
            self._last_log = now
            log.warning("KV events from %s: %s", self.url, reason, extra={"fields": {"url": self.url}})
