"""The agent's end of the engine's KV-event stream: the SUB socket, and a watch that notices
when nothing arrives on it although the engine is working.

vLLM binds its PUB to wildcard endpoints (``tcp://*:5557``) and connects to a named host; the
agent does the opposite: it connects to ``tcp://engine:5557`` and binds ``tcp://*:5557`` (for a
vLLM told to connect to ``tcp://<agent host>:5557``).

A wrong ``--events`` (or ``--topic``, or an engine started without KV events) looks like an idle
engine: the subscription simply stays quiet. :class:`EventsWatch` tells the two apart with the
engine's own counters (``vllm:prompt_tokens_total``, ``vllm:request_success_total``): when they
keep growing for ``--events-warn-after`` seconds and no message arrives meanwhile, it logs a
warning and the agent shows it (``events_silent`` in /health, ``kvroute_agent_events_silent`` in /metrics). An
engine whose /metrics has neither counter cannot say whether it is working: then any silence of
that length while it is up counts.

A busy engine may rightly publish nothing: short or fully cached prompts fill no new block. So
where the engine counts its cached prompt tokens and its generated ones (vLLM's
``prompt_tokens_cached`` and ``generation_tokens``), the watch warns only once a block must have
been filled: a request's computed tokens start at a block boundary (a hit is whole blocks), so
one that computed ``block_size`` of them filled one, and when the requests since the last message
computed more than ``(block_size - 1)`` each, one of them did.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvservice.lifecycle import StartupError, listening
from worker_agent.engine import ComputedTokens
from worker_agent.metrics import AgentCounters

log = logging.getLogger(__name__)
# The agent's reader moves messages into its inbox (worker_agent.inbox, bounded in bytes too) as
# they arrive, so ZMQ's own queue stays near empty; this only caps it should the reader fall behind.
RECEIVE_HWM = 1_000


def binds(endpoint: str) -> bool:
    """True when the agent binds ``endpoint`` (a wildcard host, allowed only with --events-bind)
    rather than connecting to it."""
    return "*" in endpoint or "::" in endpoint or "//0.0.0.0:" in endpoint


def subscribe(socket: zmq.asyncio.Socket, endpoint: str, topic: str, max_message_bytes: int = 16 << 20) -> None:
    """Set up ``socket`` (a SUB) for ``topic`` and bind or connect it to ``endpoint``. A bind that
    fails (the port is taken) or an endpoint ZMQ rejects is a :class:`StartupError`.

    A frame over ``max_message_bytes`` makes ZMQ drop the connection before the frame is held
    (ZMQ_MAXMSGSIZE): it never reaches the agent, and shows as a sequence gap once the engine's
    publisher is connected again."""
    socket.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
    socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
    try:
        if binds(endpoint):
            with listening("the engine's KV events", endpoint, "--events"):
                socket.bind(endpoint)  # the engine was given tcp://<this host>:port: it connects
        else:
            socket.connect(endpoint)
    except zmq.ZMQError as exc:
        raise StartupError(f"cannot use --events {endpoint}: {exc.strerror}") from None


async def stay_connected(socket: zmq.asyncio.Socket, endpoint: str, counters: AgentCounters) -> None:
    """Forever: count each dropped connection to the engine's publisher, and connect again.

    ZMQ reconnects a connection that failed by itself, but not one it dropped for a protocol error,
    and a frame over ZMQ_MAXMSGSIZE is one: the agent would never hear the engine again. So on every
    disconnect of an endpoint it connects to, the agent disconnects and connects it afresh (which is
    what ZMQ would have done for any other failure). A bound endpoint needs nothing: the engine's
    PUB connects, and reconnects, by itself."""
    monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    last_log = 0.0
    try:
        while True:
            parse_monitor_message(await monitor.recv_multipart())
            counters.events_disconnects += 1
            if time.monotonic() - last_log > 5.0:
                last_log = time.monotonic()
                log.warning(
                    "lost the connection to the KV-event publisher at %s (%d so far): the engine went away, "
                    "or sent a message over --max-message-bytes (it is a gap); connecting again",
                    endpoint,
                    counters.events_disconnects,
                )
            if not binds(endpoint):
                socket.disconnect(endpoint)
                socket.connect(endpoint)
    finally:
        socket.disable_monitor()
        monitor.close(linger=0)


class EventsWatch:
    """Is the engine working while no KV-event message arrives? See the module's docstring."""

    def __init__(
        self, endpoint: str, topic: str, warn_after_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.endpoint = endpoint
        self.topic = topic
        self.warn_after_s = warn_after_s
        self.silent = False
        self.last_message_time: float | None = None  # wall clock (for /metrics)
        self._clock = clock
        self._last_message: float | None = None
        self._work: float | None = None  # the engine's work counters at the last look
        # The first and the latest look that saw the engine working since the last message: the
        # engine must keep working that long unanswered (one request, or a message that overtook
        # the counters, never makes it warn).
        self._first_work: float | None = None
        self._latest_work: float | None = None
        self._since: ComputedTokens | None = None  # the engine's computed tokens at the first look since a message
        self._filled_a_block = False  # whether they since prove a block filled (True: no such counters)

    def message(self) -> None:
        """A message arrived (any: even one that fails to decode shows the endpoint is right)."""
        self._last_message = self._clock()
        self.last_message_time = time.time()
        self._first_work = self._latest_work = self._since = None
        self._filled_a_block = False
        if self.silent:
            self.silent = False
            log.info("KV events arrive again from %s", self.endpoint, extra={"fields": {"endpoint": self.endpoint}})

    def seconds_since_message(self) -> float | None:
        return None if self._last_message is None else self._clock() - self._last_message

    def engine_up(self, work: float | None, computed: ComputedTokens | None = None) -> None:
        """The engine answered /metrics; ``work`` is its work counters' sum (None: it has none, and
        being up is all it can say), ``computed`` its computed tokens (None: it does not count them)."""
        grew = work is None or (self._work is not None and work > self._work)
        self._work = work
        self._filled_a_block = computed is None or self._proves_a_block(computed)
        if grew:
            now = self._clock()
            self._first_work = now if self._first_work is None else self._first_work
            self._latest_work = now

    def _proves_a_block(self, computed: ComputedTokens) -> bool:
        since = self._since
        if since is None or computed.tokens < since.tokens or computed.finished < since.finished:
            self._since = computed  # the first look since a message, or a new process's counters
            return False
        requests = computed.finished - since.finished + computed.in_flight
        return computed.tokens - since.tokens > requests * (computed.block_size - 1)

    def engine_down(self) -> None:
        """The engine is down: nothing to expect from it (a new process starts its counters at 0)."""
        self._work = self._first_work = self._latest_work = self._since = None
        self._filled_a_block = False
        self.silent = False

    def check(self) -> bool:
        """Warn once when the engine has been working for ``warn_after_s`` with no message since;
        True while that lasts (until a message arrives or the engine goes down)."""
        if self.silent or self.warn_after_s <= 0 or self._first_work is None or self._latest_work is None:
            return self.silent
        if not self._filled_a_block:  # working, but on cached or short prompts: nothing to publish
            return False
        waited = self._latest_work - self._first_work
        if waited < self.warn_after_s:
            return False
        self.silent = True
        doing = "was up" if self._work is None else "kept serving requests (its vllm: request counters grew)"
        log.warning(
            "no KV events from %s for %.0f s while the engine %s: check that --events is the engine's ZMQ "
            "publisher as seen from here (vLLM's kv-events-config endpoint), that --topic %r is its topic, "
            "and that the engine runs with enable_kv_cache_events",
            self.endpoint,
            waited,
            doing,
            self.topic,
            extra={"fields": {"endpoint": self.endpoint, "topic": self.topic, "seconds": round(waited, 1)}},
        )
        return True
