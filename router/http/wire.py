"""The bytes of the router's HTTP/1.1: a request as the server hands it to a handler, and a reply
written straight to the socket (a whole body with its length, or a stream).

A reply's head is written here, never from a header value that holds a line break (one could
split the reply). A client that speaks HTTP/1.0 gets no chunked body: a stream to it is ended by
closing the connection. A HEAD request's reply has the head a GET would have and no body.
"""

from __future__ import annotations

import http
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from multidict import CIMultiDict

from router.http.edges import ApiError, error_body, error_headers

REASONS = {status.value: status.phrase for status in http.HTTPStatus}
JSON = "application/json; charset=utf-8"


@dataclass
class HttpRequest:
    """A request, read whole, with the id the router logs it under; handlers fill ``log_fields``
    in for the access log."""

    method: str
    path: str
    query: str
    headers: CIMultiDict[str]
    body: bytes
    request_id: str
    log_fields: dict[str, Any] = field(default_factory=dict)


class Wire(Protocol):
    """Where a reply's bytes go: a client connection."""

    def write(self, *pieces: bytes) -> None: ...

    async def drain(self) -> None: ...


def splits_reply(name: str, value: str) -> bool:
    """Whether a header holds a line break: written, it could split the reply (never written)."""
    return "\n" in value or "\r" in value or "\n" in name or "\r" in name


def encode_head(status: int, headers: Mapping[str, str], framing: bytes, keep_alive: bool) -> bytes:
    """A reply's head: the status line, ``headers`` (none with a line break: one could split the
    reply), ``framing`` (its length or chunked), and ``Connection: close`` when it is the last."""
    lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Unknown')}\r\n"]
    for name, value in headers.items():
        if not splits_reply(name, value):
            lines.append(f"{name}: {value}\r\n")
    closing = b"" if keep_alive else b"Connection: close\r\n"
    return "".join(lines).encode("utf-8", "surrogateescape") + framing + closing + b"\r\n"


def error_parts(exc: ApiError) -> tuple[dict[str, str], bytes]:
    """An API error's reply headers and body, in OpenAI's shape."""
    body = json.dumps(error_body(exc.status, exc.message, exc.kind, exc.param)).encode()
    return {"Content-Type": JSON, **error_headers(exc)}, body


def error_reply(exc: ApiError, keep_alive: bool) -> bytes:
    """The whole reply of an API error, in OpenAI's shape."""
    headers, body = error_parts(exc)
    return encode_head(exc.status, headers, b"Content-Length: %d\r\n" % len(body), keep_alive) + body


class Reply:
    """One request's reply (:class:`router.upstream.proxy.Downstream`): a whole reply with its length, or
    a stream, chunked for HTTP/1.1 and ended by the close for HTTP/1.0."""

    def __init__(self, wire: Wire, keep_alive: bool, chunked: bool = True, head_only: bool = False) -> None:
        self._wire = wire
        self._chunked = chunked
        self._head_only = head_only
        self.keep_alive = keep_alive
        self.status = 0
        self.started = False  # its head was written
        self.ended = False  # all of it was written: the connection may carry the next request

    def _begin(self, status: int) -> None:
        self.status, self.started = status, True

    async def send_whole(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        self._begin(status)
        head = encode_head(status, headers, b"Content-Length: %d\r\n" % len(body), self.keep_alive)
        self._wire.write(head, b"" if self._head_only else body)
        self.ended = True

    async def send_json(self, value: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> None:
        await self.send_whole(status, {"Content-Type": JSON, **(headers or {})}, json.dumps(value).encode())

    async def start(self, status: int, headers: Mapping[str, str]) -> None:
        self._begin(status)
        if not self._chunked:
            self.keep_alive = False  # HTTP/1.0: the close ends the body
        framing = b"Transfer-Encoding: chunked\r\n" if self._chunked else b""
        self._wire.write(encode_head(status, headers, framing, self.keep_alive))

    async def write(self, chunk: bytes) -> None:
        if not chunk or self._head_only:  # an empty chunk would end the body
            return
        if self._chunked:
            self._wire.write(b"%x\r\n" % len(chunk), chunk, b"\r\n")
        else:
            self._wire.write(chunk)
        await self._wire.drain()

    async def end(self) -> None:
        if self._chunked and not self._head_only:
            self._wire.write(b"0\r\n\r\n")
        self.ended = True

    def send_error(self, exc: ApiError) -> None:
        self._begin(exc.status)
        whole = error_reply(exc, self.keep_alive)
        self._wire.write(whole[: whole.index(b"\r\n\r\n") + 4] if self._head_only else whole)
        self.ended = True


Handler = Callable[[HttpRequest, Reply], Any]  # an awaitable: ``async def handler(request, reply)``
