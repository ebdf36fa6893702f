"""Forwarding a request to the chosen worker, bytes in and bytes out.

The request body goes upstream unchanged; the reply streams back unchanged (SSE or JSON), while
a small reader looks for the usage object to compare predicted and reported cached tokens. If the
chosen worker fails before its first byte (connection refused, reset, timeout, a 5xx, a
redirect), the request goes once to the next best worker. When the client goes away, the upstream
connection is closed, which makes the engine abort the request.

Headers follow RFC 9110 section 7.6.1: the hop-by-hop ones, and every header the ``Connection``
header names, stay on their hop, both ways. Redirects are never followed (a worker's redirect
could point the prompt anywhere). The reply's ``Content-Encoding`` goes with its body, which is
relayed as sent. ``X-Request-Id`` goes upstream once, the value the router logs; ``Expect``
stays on the client's hop (the router has read the whole body). Errors told to the client name
no worker address; the log has them. The connections to the workers: :mod:`router.upstream.pool`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from multidict import CIMultiDict, CIMultiDictProxy

from router.routing.scoring import Candidate
from router.upstream.http1 import Reply, UpstreamBroken
from router.upstream.pool import UpstreamPool
from router.upstream.usage import SseUsage, usage_from_json

HOP_BY_HOP = frozenset(
    {
        "connection",
        "proxy-connection",
        "keep-alive",
        "transfer-encoding",
        "upgrade",
        "te",
        "trailer",
        "proxy-authorization",
        "proxy-authenticate",
    }
)
SET_BY_THE_HOP = frozenset({"host", "content-length"})  # written for each hop
# The router's key; its own id is sent; the body is sent whole (no 100-continue upstream).
NOT_FORWARDED = frozenset({"authorization", "x-request-id", "expect"})
# An engine's software and version are not the client's business (a reverse proxy's custom).
NOT_RELAYED = frozenset({"server"})
MAX_TRIES = 2  # the chosen worker, then the next best if the first fails before replying
MAX_JSON_SNIFF = 4 << 20  # the usage of non-streamed replies larger than this is not read


class UpstreamFailed(Exception):
    """Every worker tried failed before sending a byte (502)."""


class Tries(Protocol):
    """What the transport tells of each try on a worker to the request's load owner
    (:class:`router.routing.booking.Booking`), without knowing it: a try starts, fails before its
    first byte, gets its first byte, ends with the reply's usage."""

    def attempt(self, candidate: Candidate, uncached: int | None = None) -> None: ...

    def failed(self, candidate: Candidate) -> None: ...

    def prefilled(self, candidate: Candidate) -> None: ...

    def replied(self, candidate: Candidate, usage: dict | None) -> None: ...


class Downstream(Protocol):
    """The client's side of a relayed reply (:class:`router.http.wire.Reply`): a whole
    reply in one go, or a stream's status and headers, its pieces, its end. A write to a client
    that went away raises ConnectionError."""

    async def send_whole(self, status: int, headers: CIMultiDict[str], body: bytes) -> None: ...

    async def start(self, status: int, headers: CIMultiDict[str]) -> None: ...

    async def write(self, chunk: bytes) -> None: ...

    async def end(self) -> None: ...


@dataclass
class Forwarded:
    candidate: Candidate
    usage: dict | None
    retried: bool


def end_to_end(
    headers: CIMultiDictProxy[str] | CIMultiDict[str], drop: frozenset[str] = frozenset()
) -> CIMultiDict[str]:
    """``headers`` less the hop-by-hop ones: those RFC 9110 names and those its Connection names."""
    named = {token.strip().lower() for value in headers.getall("Connection", []) for token in value.split(",")}
    dropped = HOP_BY_HOP | SET_BY_THE_HOP | drop | named
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in dropped)


def reply_headers(headers: CIMultiDictProxy[str] | CIMultiDict[str]) -> CIMultiDict[str]:
    """A worker's reply headers as the client gets them: end to end, without the engine's ``Server``."""
    return end_to_end(headers, NOT_RELAYED)


def request_headers(headers: CIMultiDictProxy[str] | CIMultiDict[str], request_id: str) -> CIMultiDict[str]:
    forwarded = end_to_end(headers, NOT_FORWARDED)
    forwarded["X-Request-Id"] = request_id
    return forwarded


def failure_text(why: BaseException | int) -> str:
    """What went wrong, without the address (system errors name host and port)."""
    if isinstance(why, int):
        return f"it answered {why}" if why >= 400 else f"it answered with a redirect ({why}, not followed)"
    if isinstance(why, TimeoutError):
        return "it timed out"
    if isinstance(why, UpstreamBroken):
        return str(why)  # which of "closed early" and "not HTTP" it was; no address in it
    if isinstance(why, ConnectionError):
        return "the connection failed"
    return f"the exchange failed ({type(why).__name__})"


@dataclass(frozen=True)
class Outgoing:
    """What goes to the worker: the client's path, headers and id, and the body as sent."""

    path: str
    headers: CIMultiDictProxy[str] | CIMultiDict[str]
    request_id: str
    body: bytes


async def forward(
    outgoing: Outgoing,
    downstream: Downstream,
    pool: UpstreamPool,
    candidates: list[Candidate],
    reply_headers: Callable[[Candidate], dict[str, str]],
    booking: Tries,
    on_failure: Callable[[Candidate, BaseException | int], None],
) -> Forwarded:
    """Send to ``candidates[0]``, or to ``candidates[1]`` if the first fails before replying, and
    relay the reply to ``downstream``. ``booking`` books each try and releases a failed one's
    load and, at the reply's first byte (for a stream: the first token, so the prompt's prefill
    is done), its prefill; ``on_failure`` is told of each failed try."""
    headers = request_headers(outgoing.headers, outgoing.request_id)
    path, body = outgoing.path, outgoing.body
    last: BaseException | int | None = None
    for attempt, candidate in enumerate(candidates[:MAX_TRIES]):
        booking.attempt(candidate)
        try:
            upstream = await pool.post(candidate.url + path, body, headers.items())
        except (TimeoutError, OSError) as exc:
            last = exc
            booking.failed(candidate)
            on_failure(candidate, exc)
            continue
        redirect = 300 <= upstream.status < 400
        if redirect or (upstream.status >= 500 and attempt + 1 < min(MAX_TRIES, len(candidates))):
            last = upstream.status
            upstream.close()
            booking.failed(candidate)
            on_failure(candidate, upstream.status)
            continue
        try:
            first_byte = functools.partial(booking.prefilled, candidate)
            usage = await _relay(downstream, upstream, reply_headers(candidate), first_byte)
            booking.replied(candidate, usage)
        finally:
            upstream.close()  # kept if read to its end; else closed: the engine aborts the request
        return Forwarded(candidate, usage, retried=attempt > 0)
    why = "no worker was tried" if last is None else failure_text(last)
    raise UpstreamFailed(f"the worker failed before replying: {why}")


async def _relay(
    downstream: Downstream,
    upstream: Reply,
    extra_headers: dict[str, str],
    on_first_byte: Callable[[], None],
) -> dict | None:
    headers = reply_headers(upstream.headers)  # Content-Encoding stays: the body is relayed as sent
    headers.update(extra_headers)  # replaces the worker's X-Request-Id, whatever its case
    streamed = upstream.headers.get("Content-Type", "").startswith("text/event-stream")
    length = upstream.content_length
    if not streamed and length is not None and length <= MAX_JSON_SNIFF:
        # A whole reply of known size: one write instead of a chunked stream, sent before the
        # bookkeeping that follows it (usage, the TTFT model, metrics, the access log's fields),
        # which the client need not wait for.
        body = await upstream.read()
        on_first_byte()
        with contextlib.suppress(ConnectionError):  # the client went away: its request is still accounted
            await downstream.send_whole(upstream.status, headers, body)
        return usage_from_json(body)
    await downstream.start(upstream.status, headers)
    sse = SseUsage()
    kept = bytearray()
    first = True
    async for chunk in upstream.iter_any():  # the client going away raises here
        if first:
            on_first_byte()
            first = False
        await downstream.write(chunk)
        if streamed:
            sse.feed(chunk)
        elif len(kept) < MAX_JSON_SNIFF:
            kept += chunk
    await downstream.end()
    return sse.usage if streamed else usage_from_json(bytes(kept))
