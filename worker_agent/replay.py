"""Fetching missed batches from the engine's replay socket (vLLM's ZMQ ROUTER).

A DEALER, not a REQ: the engine answers one request with many messages (each buffered batch
from ``start_seq`` on, then an end marker), and a REQ socket only ever receives the first.
Each fetch uses a fresh socket, so a late answer to an abandoned fetch can never be mistaken
for the answer to the next one.

A fetch ends at the end marker, after ``timeout_s`` without a message, at ``deadline_s`` in all
(an engine that keeps trickling would otherwise hold the agent's event stream forever), or past
``max_bytes``; what came by then is used, and whatever is missing is a gap the pipeline handles.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from kvevents.events import REPLAY_END_SEQ

log = logging.getLogger(__name__)
END_MARKER_SEQ = REPLAY_END_SEQ.to_bytes(8, "big")


@dataclass
class ReplayResult:
    """Messages (topic, seq, payload frames) in the order received; ``complete`` once the end
    marker arrived within the timeout."""

    messages: list[list[bytes]] = field(default_factory=list)
    complete: bool = False
    ended_by: str = ""  # why an incomplete fetch ended: "idle", "deadline" or "size"


class ReplayClient:
    def __init__(
        self,
        context: zmq.asyncio.Context,
        endpoint: str,
        timeout_s: float = 2.0,
        deadline_s: float = 5.0,
        max_message_bytes: int = 16 << 20,
        max_bytes: int = 256 << 20,
    ) -> None:
        self._context = context
        self.endpoint = endpoint
        self._timeout_s = timeout_s
        self._deadline_s = deadline_s
        self._max_message_bytes = max_message_bytes  # a bigger frame drops the connection (ZMQ_MAXMSGSIZE)
        self._max_bytes = max_bytes  # what one answer may bring in all: the rest is a gap

    async def fetch(self, start_seq: int) -> ReplayResult:
        result = ReplayResult()
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RCVHWM, 0)  # the answer may be the whole buffer: don't drop any
        socket.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
        deadline = time.monotonic() + self._deadline_s
        size = 0
        try:
            socket.connect(self.endpoint)
            await socket.send_multipart([b"", start_seq.to_bytes(8, "big")])
            while not result.complete:
                left = deadline - time.monotonic()
                try:  # an idle timeout (a long answer keeps arriving) within the total bound
                    frames = await asyncio.wait_for(socket.recv_multipart(), min(self._timeout_s, max(left, 0.0)))
                except TimeoutError:
                    result.ended_by = "idle" if left > self._timeout_s else "deadline"
                    break
                self._take(frames, result)
                size += sum(len(frame) for frame in frames)
                if size > self._max_bytes and not result.complete:
                    result.ended_by = "size"
                    break
        finally:
            socket.close(linger=0)
        if not result.complete:
            log.warning(
                "replay from %s (start seq %d) ended without its end marker after %d messages (%s)",
                self.endpoint,
                start_seq,
                len(result.messages),
                self._why(result.ended_by),
            )
        return result

    def _why(self, ended_by: str) -> str:
        if ended_by == "idle":
            return f"nothing for {self._timeout_s:g} s"
        if ended_by == "size":
            return f"over {self._max_bytes} bytes"
        return f"{self._deadline_s:g} s in all"

    @staticmethod
    def _take(frames: list[bytes], result: ReplayResult) -> None:
        # the end marker: [b"", b"", END, b""] (vLLM, SGLang 0.5.23) or [b"", END, b""] (earlier SGLang)
        if len(frames) in (3, 4) and frames[0] == b"" and frames[-2] == END_MARKER_SEQ and frames[-1] == b"":
            result.complete = True
            return
        result.messages.append(frames[1:] if frames and frames[0] == b"" else frames)
