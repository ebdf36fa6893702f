"""Forwarding a request to the chosen worker, bytes in and bytes out.

The request body goes upstream unchanged; the reply streams back unchanged (SSE or JSON), while
a small reader looks for the usage object to compare predicted and reported cached tokens. If the
chosen worker fails before its first byte (connection refused, reset, timeout, a 5xx), the
request goes once to the next best worker. When the client goes away, the upstream connection is
closed, which makes the engine abort the request.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from router.booking import Booking
from router.metrics import SseUsage, usage_from_json
from router.middleware import REQUEST_ID
from router.scoring import Candidate

HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "content-length",
    "content-encoding",
    "host",
    "upgrade",
    "te",
    "trailer",
    "proxy-authorization",
    "proxy-authenticate",
}
MAX_TRIES = 2  # the chosen worker, then the next best if the first fails before replying
MAX_JSON_SNIFF = 4 << 20  # the usage of non-streamed replies larger than this is not read


class UpstreamFailed(Exception):
    """Every worker tried failed before sending a byte (502)."""


@dataclass
class Forwarded:
    response: web.StreamResponse
    candidate: Candidate
    usage: dict | None
    retried: bool


def _request_headers(request: web.Request) -> dict[str, str]:
    headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP | {"authorization"}}
    headers["X-Request-Id"] = request[REQUEST_ID]
    return headers


async def forward(
    request: web.Request,
    session: aiohttp.ClientSession,
    path: str,
    body: bytes,
    candidates: list[Candidate],
    reply_headers: Callable[[Candidate], dict[str, str]],
    booking: Booking,
    on_failure: Callable[[Candidate, BaseException | int], None],
) -> Forwarded:
    """Send to ``candidates[0]``, or to ``candidates[1]`` if the first fails before replying.
    ``booking`` books each try and releases a failed one's load and, at the reply's first byte (for
    a stream: the first token, so the prompt's prefill is done), its prefill; ``on_failure`` is
    told of each failed try."""
    headers = _request_headers(request)
    last: BaseException | int | None = None
    for attempt, candidate in enumerate(candidates[:MAX_TRIES]):
        booking.attempt(candidate)
        try:
            upstream = await session.post(candidate.url + path, data=body, headers=headers)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            last = exc
            booking.failed(candidate)
            on_failure(candidate, exc)
            continue
        if upstream.status >= 500 and attempt + 1 < min(MAX_TRIES, len(candidates)):
            last = upstream.status
            upstream.release()
            booking.failed(candidate)
            on_failure(candidate, upstream.status)
            continue
        try:
            first_byte = functools.partial(booking.prefilled, candidate)
            response, usage = await _relay(request, upstream, reply_headers(candidate), first_byte)
        finally:
            upstream.close()  # not release(): an unfinished stream must abort the engine's request
        return Forwarded(response, candidate, usage, retried=attempt > 0)
    raise UpstreamFailed(f"upstream failed: {last!r}")


async def _relay(
    request: web.Request,
    upstream: aiohttp.ClientResponse,
    extra_headers: dict[str, str],
    on_first_byte: Callable[[], None],
) -> tuple[web.StreamResponse, dict | None]:
    headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}
    headers.update(extra_headers)
    streamed = upstream.headers.get("Content-Type", "").startswith("text/event-stream")
    length = upstream.content_length
    if not streamed and length is not None and length <= MAX_JSON_SNIFF:
        # A whole reply of known size: one write instead of a chunked stream.
        body = await upstream.read()
        on_first_byte()
        return web.Response(status=upstream.status, body=body, headers=headers), usage_from_json(body)
    response = web.StreamResponse(status=upstream.status, headers=headers)
    await response.prepare(request)
    sse = SseUsage()
    kept = bytearray()
    first = True
    async for chunk in upstream.content.iter_any():  # the client going away raises here
        if first:
            on_first_byte()
            first = False
        await response.write(chunk)
        if streamed:
            sse.feed(chunk)
        elif len(kept) < MAX_JSON_SNIFF:
            kept += chunk
    await response.write_eof()
    usage = sse.usage if streamed else usage_from_json(bytes(kept))
    return response, usage
