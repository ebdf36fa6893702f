"""The two legs of a request split over a prefill worker and a decode worker, as vLLM's
disaggregated-serving proxies send them (its NIXL and P2P examples; the choice of the two workers:
:mod:`router.routing.pd`).

1. The prefill leg: the client's body with ``kv_transfer_params`` asking for a remote decode
   (``do_remote_decode: true``), not streamed, one output token (``max_tokens``, and
   ``max_completion_tokens`` where given, 1; ``min_tokens``, ``min_completion_tokens`` and
   ``stream_options`` dropped, as the engine takes none of them for it). Its JSON reply carries the
   ``kv_transfer_params`` that name the KV blocks it computed; its usage says how much of the
   prompt the prefill worker's cache held (a connector that shares the KV through a store, such as
   vLLM's ExampleConnector or LMCache's, returns none: the decode engine finds the KV by the
   prompt's hashes, and the decode leg goes without them). A prefill worker that fails before
   replying (no connection, a 5xx) is replaced by the next one once; a 4xx is the client's
   mistake and is relayed as it is.
2. The decode leg: the client's body as sent, with those ``kv_transfer_params``, to the decode
   worker; its reply (streamed or whole) is relayed to the client with its usage's
   ``cached_tokens`` replaced by the prefill worker's (the decode worker counts the transferred
   KV as cached). A decode worker that refuses the connection is replaced by the next once (it
   never saw the request; the prefill worker still holds the KV); one that fails otherwise before
   replying is not (it may have pulled the KV), and the client gets a 502 saying so.

Both legs carry the router's request id, so the engines' logs pair them.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from multidict import CIMultiDict

from router.routing.scoring import Candidate
from router.upstream.pool import UpstreamPool
from router.upstream.proxy import (
    MAX_JSON_SNIFF,
    MAX_TRIES,
    Downstream,
    Outgoing,
    Tries,
    UpstreamFailed,
    failure_text,
    reply_headers,
    request_headers,
)
from router.upstream.usage import usage_from_json

# What the prefill leg asks of the engine's connector: compute, keep the KV for a remote decode.
PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
NOT_FOR_PREFILL = ("min_tokens", "min_completion_tokens", "stream_options")


class ClientMistake(Exception):
    """The prefill worker refused the request (4xx): relayed to the client as it is."""

    def __init__(self, status: int, headers: CIMultiDict[str], body: bytes) -> None:
        super().__init__(status)
        self.status, self.headers, self.body = status, headers, body


@dataclass(frozen=True)
class Prefilled:
    candidate: Candidate
    # where its KV is (NIXL, P2P); None from a connector that shares through a store, which the
    # decode engine reads by the prompt's hashes (vLLM's ExampleConnector, LMCache's shared storage)
    kv_transfer_params: dict[str, Any] | None
    usage: dict | None
    retried: bool

    @property
    def cached_tokens(self) -> int | None:
        cached = ((self.usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
        return cached if isinstance(cached, int) and not isinstance(cached, bool) else None


def prefill_body(body: dict[str, Any]) -> bytes:
    leg = {k: v for k, v in body.items() if k not in NOT_FOR_PREFILL}
    leg["kv_transfer_params"] = dict(PREFILL_PARAMS)
    leg["stream"] = False
    leg["max_tokens"] = 1
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    return json.dumps(leg).encode()


def decode_leg_body(body: dict[str, Any], kv_transfer_params: dict[str, Any] | None) -> bytes:
    if kv_transfer_params is None:
        return json.dumps(body).encode()
    return json.dumps({**body, "kv_transfer_params": kv_transfer_params}).encode()


async def prefill(
    outgoing: Outgoing,
    pool: UpstreamPool,
    candidates: list[Candidate],
    booking: Tries,
    on_failure: Callable[[Candidate, BaseException | int], None],
) -> Prefilled:
    """The prefill leg on ``candidates[0]``, or on ``candidates[1]`` if the first fails."""
    headers = request_headers(outgoing.headers, outgoing.request_id)
    last: BaseException | int | None = None
    for attempt, candidate in enumerate(candidates[:MAX_TRIES]):
        booking.attempt(candidate)
        try:
            reply = await pool.post(candidate.url + outgoing.path, outgoing.body, headers.items())
            try:
                body = await reply.read()
            finally:
                reply.close()
        except (TimeoutError, OSError) as exc:
            last = exc
        else:
            if 400 <= reply.status < 500:
                raise ClientMistake(reply.status, reply_headers(reply.headers), body)
            if reply.status == 200:
                booking.prefilled(candidate)
                usage = usage_from_json(body)
                booking.replied(candidate, usage)
                return Prefilled(candidate, _transfer_params(body), usage, retried=attempt > 0)
            last = reply.status
        booking.failed(candidate)
        on_failure(candidate, last)
    why = "no prefill worker was tried" if last is None else failure_text(last)
    raise UpstreamFailed(f"the prefill worker failed before replying: {why}")


def _transfer_params(body: bytes) -> dict[str, Any] | None:
    try:
        params = json.loads(body).get("kv_transfer_params")
    except (ValueError, AttributeError):
        return None
    return params if isinstance(params, dict) and params else None


async def decode(
    outgoing: Outgoing,
    downstream: Downstream,
    pool: UpstreamPool,
    candidates: list[Candidate],
    reply: tuple[Callable[[Candidate], dict[str, str]], int | None],
    booking: Tries,
    on_failure: Callable[[Candidate, BaseException | int], None],
) -> tuple[Candidate, dict | None, float | None]:
    """The decode leg on ``candidates[0]``, relayed to ``downstream`` with ``reply``'s headers for
    the worker and the prefill side's cached tokens: the worker, its usage (as the client saw
    it) and, for a stream, the seconds to its first byte. A worker that refuses the connection
    never saw the request, and the prefill worker still holds the KV for whoever pulls it: the
    next one is tried. Any other failure before replying is UpstreamFailed: the KV may have been
    pulled by the failed worker."""
    headers = request_headers(outgoing.headers, outgoing.request_id)
    last: BaseException | None = None
    started = time.perf_counter()
    for candidate in candidates[:MAX_TRIES]:
        booking.attempt(candidate, uncached=0)  # its KV comes from the prefill worker
        try:
            upstream = await pool.post(candidate.url + outgoing.path, outgoing.body, headers.items())
        except ConnectionRefusedError as exc:
            booking.failed(candidate)
            on_failure(candidate, exc)
            last = exc
            continue
        except (TimeoutError, OSError) as exc:
            booking.failed(candidate)
            on_failure(candidate, exc)
            raise UpstreamFailed(_decode_lost(failure_text(exc))) from None
        try:
            if upstream.status >= 500 or 300 <= upstream.status < 400:
                booking.failed(candidate)
                on_failure(candidate, upstream.status)
                raise UpstreamFailed(_decode_lost(failure_text(upstream.status)))
            usage, first_at = await _relay_rewritten(
                downstream, upstream, reply[0](candidate), booking, candidate, reply[1]
            )
            booking.replied(candidate, usage)
            return candidate, usage, None if first_at is None else first_at - started
        finally:
            upstream.close()
    why = "no decode worker was tried" if last is None else failure_text(last)
    raise UpstreamFailed(f"no decode worker took the request ({why})")


def _decode_lost(why: str) -> str:
    return f"the decode worker failed before replying ({why}); the prompt's KV computed for it is lost"


async def _relay_rewritten(
    downstream: Downstream,
    upstream: Any,
    extra_headers: dict[str, str],
    booking: Tries,
    candidate: Candidate,
    cached_tokens: int | None,
) -> tuple[dict | None, float | None]:
    """Relay the decode worker's reply with the prefill side's cached tokens in its usage: the
    usage, and for a stream when its first byte came (perf_counter)."""
    headers = reply_headers(upstream.headers)
    headers.update(extra_headers)
    encoded = "Content-Encoding" in upstream.headers  # a compressed body is relayed as sent
    rewrite = None if encoded or cached_tokens is None else cached_tokens
    streamed = upstream.headers.get("Content-Type", "").startswith("text/event-stream")
    if not streamed:
        body = await upstream.read()
        booking.prefilled(candidate)
        if rewrite is not None and len(body) <= MAX_JSON_SNIFF:
            body = with_cached_tokens(body, rewrite)
        with contextlib.suppress(ConnectionError):  # the client went away: still accounted
            await downstream.send_whole(upstream.status, headers, body)
        return usage_from_json(body), None
    await downstream.start(upstream.status, headers)
    events = SseRewriter(rewrite)
    first_at: float | None = None
    async for chunk in upstream.iter_any():  # the client going away raises here
        if first_at is None:
            first_at = time.perf_counter()
            booking.prefilled(candidate)
        await downstream.write(events.feed(chunk))
    await downstream.write(events.flush())
    await downstream.end()
    return events.usage, first_at


def with_cached_tokens(body: bytes, cached_tokens: int) -> bytes:
    """A JSON reply with ``usage.prompt_tokens_details.cached_tokens`` set (unchanged when it has
    no usage or is not JSON)."""
    try:
        reply = json.loads(body)
    except ValueError:
        return body
    usage = reply.get("usage") if isinstance(reply, dict) else None
    if not isinstance(usage, dict):
        return body
    details = usage.get("prompt_tokens_details")
    usage["prompt_tokens_details"] = {**(details if isinstance(details, dict) else {}), "cached_tokens": cached_tokens}
    return json.dumps(reply).encode()


class SseRewriter:
    """A server-sent event stream passed on event by event, the usage object's ``cached_tokens``
    replaced where one comes (``cached_tokens`` None: passed unchanged, the usage still read)."""

    def __init__(self, cached_tokens: int | None) -> None:
        self._cached = cached_tokens
        self._tail = b""
        self.usage: dict | None = None

    def feed(self, chunk: bytes) -> bytes:
        data = self._tail + chunk
        *events, self._tail = data.split(b"\n\n")
        if len(self._tail) > MAX_JSON_SNIFF:  # no event boundary in sight: pass it on as it is
            events.append(self._tail)
            self._tail = b""
            return b"\n\n".join(events)
        return b"".join(self._event(e) + b"\n\n" for e in events)

    def flush(self) -> bytes:
        tail, self._tail = self._tail, b""
        return tail

    def _event(self, event: bytes) -> bytes:
        if b'"usage"' not in event:
            return event
        lines = event.split(b"\n")
        for i, line in enumerate(lines):
            if line.startswith(b"data:") and (usage := usage_from_json(line[5:].strip())) is not None:
                if self._cached is not None:
                    line = b"data: " + with_cached_tokens(line[5:].strip(), self._cached)
                    lines[i] = line
                    usage = usage_from_json(line[5:].strip())
                self.usage = usage
        return b"\n".join(lines)
