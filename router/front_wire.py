"""The lean front's bytes: a request's head framed and checked, a reply's head and body written.

A head is checked by llhttp (``httptools``, the parser of uvicorn and of aiohttp's C side), not
by hand: it refuses what request smuggling relies on (a bad or doubled ``Content-Length``, a
header name with a space, bare line feeds). Whatever it refuses goes to aiohttp, which answers
it as before.
"""

from __future__ import annotations

import http
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httptools
from multidict import CIMultiDict

from router.middleware import ApiError, error_body, error_headers

if TYPE_CHECKING:
    from router.front import FrontConnection

MAX_LINE = 8190  # the request line, as aiohttp's own limit; longer: aiohttp answers it
MAX_HEAD = 64 << 10  # the whole head; longer: aiohttp answers it
# Heads this front leaves to aiohttp: a body framed otherwise, or a connection that changes protocol.
NOT_LEAN = frozenset({"transfer-encoding", "expect", "upgrade"})
# Requests to other endpoints passed on to aiohttp's server over a private socket, the client's
# connection staying here; HEAD is not (its reply announces a body it does not carry).
PASSED_ON = frozenset({b"GET", b"POST", b"PUT", b"PATCH", b"DELETE", b"OPTIONS"})
REASONS = {status.value: status.phrase for status in http.HTTPStatus}


class HandOver:
    """The request is not this front's: aiohttp's server takes the connection from its first byte."""


HAND_OVER = HandOver()


@dataclass(frozen=True)
class Head:
    path: str
    headers: CIMultiDict[str]
    raw: bytes  # the head as sent, its blank line included
    length: int  # of the body
    keep_alive: bool
    passed_on: bool = False  # not a completion: passed on to aiohttp's server as is (router.front_relay)

    @property
    def head_length(self) -> int:
        return len(self.raw)

    @property
    def end(self) -> int:
        return len(self.raw) + self.length


class _HeadReader:
    """httptools' callbacks for one head."""

    def __init__(self) -> None:
        self.fields: list[tuple[bytes, bytes]] = []
        self.complete = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self.fields.append((name, value))

    def on_headers_complete(self) -> None:
        self.complete = True


def parse_head(buffer: bytearray, routes: dict[str, bool]) -> Head | HandOver | None:
    """The head at the start of ``buffer`` if it is all in and this front takes it (a completion,
    or a request without a body to pass on); HAND_OVER if it is not this front's; None while more
    of it is to come."""
    line_end = buffer.find(b"\r\n", 0, MAX_LINE + 2)
    if line_end < 0:
        return HAND_OVER if len(buffer) > MAX_LINE else None
    method, _, rest = bytes(buffer[:line_end]).partition(b" ")
    target, _, version = rest.partition(b" ")
    path = target.decode("latin-1")
    completion = method == b"POST" and path in routes
    if version != b"HTTP/1.1" or not (completion or method in PASSED_ON):
        return HAND_OVER
    blank = buffer.find(b"\r\n\r\n", line_end, MAX_HEAD)
    if blank < 0:
        return HAND_OVER if len(buffer) >= MAX_HEAD else None
    raw = bytes(buffer[: blank + 4])
    reader = _HeadReader()
    parser = httptools.HttpRequestParser(reader)
    try:
        parser.feed_data(raw)
    except httptools.HttpParserError:
        return HAND_OVER
    if not reader.complete:
        return HAND_OVER
    headers: CIMultiDict[str] = CIMultiDict(
        (name.decode("utf-8", "surrogateescape"), value.decode("utf-8", "surrogateescape"))
        for name, value in reader.fields
    )
    if any(name.lower() in NOT_LEAN for name in headers):
        return HAND_OVER
    lengths = headers.getall("Content-Length", [])
    length = int(lengths[0]) if lengths else 0  # llhttp allowed at most one, all digits
    if not completion and length:
        return HAND_OVER  # passed on only without a body: aiohttp reads other bodies itself
    return Head(path, headers, raw, length, parser.should_keep_alive(), passed_on=not completion)


def encode_head(status: int, headers: CIMultiDict[str], framing: bytes, keep_alive: bool) -> bytes:
    """A reply's head: the status line, ``headers`` (none with a line break: one could split the
    reply), ``framing`` (its length or chunked), and ``Connection: close`` when it is the last."""
    lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Unknown')}\r\n"]
    for name, value in headers.items():
        if "\n" not in value and "\r" not in value and "\n" not in name and "\r" not in name:
            lines.append(f"{name}: {value}\r\n")
    closing = b"" if keep_alive else b"Connection: close\r\n"
    return "".join(lines).encode("utf-8", "surrogateescape") + framing + closing + b"\r\n"


def error_reply(exc: ApiError, keep_alive: bool) -> bytes:
    """The whole reply of an API error, in OpenAI's shape (as :mod:`router.middleware` answers)."""
    body = json.dumps(error_body(exc.status, exc.message, exc.kind)).encode()
    headers = CIMultiDict({"Content-Type": "application/json; charset=utf-8", **error_headers(exc)})
    return encode_head(exc.status, headers, b"Content-Length: %d\r\n" % len(body), keep_alive) + body


class LeanReply:
    """:class:`router.proxy.Downstream` on a lean connection: a whole reply with its length, or a
    chunked stream."""

    def __init__(self, connection: FrontConnection, keep_alive: bool) -> None:
        self._connection = connection
        self.keep_alive = keep_alive
        self.status = 0
        self.started = False  # its head was written
        self.ended = False  # all of it was written: the connection may carry the next request

    def _begin(self, status: int) -> None:
        self.status, self.started = status, True

    async def send_whole(self, status: int, headers: CIMultiDict[str], body: bytes) -> None:
        self._begin(status)
        head = encode_head(status, headers, b"Content-Length: %d\r\n" % len(body), self.keep_alive)
        self._connection.write(head, body)
        self.ended = True

    async def start(self, status: int, headers: CIMultiDict[str]) -> None:
        self._begin(status)
        self._connection.write(encode_head(status, headers, b"Transfer-Encoding: chunked\r\n", self.keep_alive))

    async def write(self, chunk: bytes) -> None:
        if chunk:  # an empty chunk would end the body
            self._connection.write(b"%x\r\n" % len(chunk), chunk, b"\r\n")
            await self._connection.drain()

    async def end(self) -> None:
        self._connection.write(b"0\r\n\r\n")
        self.ended = True

    def send_error(self, exc: ApiError) -> None:
        self._begin(exc.status)
        self._connection.write(error_reply(exc, self.keep_alive))
        self.ended = True
