"""What every request passes through: its id, the API key, the in-flight limit, the body's
size and read deadline, OpenAI-shaped errors, the access log. Plain functions and the
:class:`Admission` counter, applied by :mod:`router.http.server` to every route.

Every error the router answers has OpenAI's shape (``{"error": {"message", "type", "param",
"code"}}``), its 404 and 405 included. The access log is one record per request with structured
fields (one JSON object per line with ``--log-format json``); scrapes, health checks and the
dashboard's polls are logged at DEBUG so that probes do not drown the requests.
"""

from __future__ import annotations

import hmac
import itertools
import logging
import os
import re
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from multidict import CIMultiDict

from kvservice.logs import log_request

access_log = logging.getLogger("router.access")
error_log = logging.getLogger("router.errors")
http_log = logging.getLogger("router.http")
# Probes, and the dashboard's polls (every 2 s per open page): logged at DEBUG.
QUIET_PATHS = frozenset({"/metrics", "/health", "/ready"})
QUIET_PREFIXES = ("/dashboard",)
# The dashboard's JSON shows the fleet's load and what is cached: behind the key like the API. Its
# page and scripts are not (a browser cannot send the key with a page load; the page asks for it).
PROTECTED_PREFIXES = ("/v1/", "/debug/", "/dashboard/api/")
REQUEST_ID_FORMAT = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")  # else a fresh id replaces it
RETRY_AFTER_S = 1  # told to clients refused past the in-flight limit
CLIENT_GONE = 499  # the status logged and counted for a request whose client went away (nginx's)
UNMATCHED = "unmatched"  # the metrics label of paths no route serves (bounded label values)


class ApiError(Exception):
    """An answer in OpenAI's error shape; ``headers`` go with it (a 405's ``Allow``)."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.headers = headers or {}
        self.param = param  # the request field at fault, where one is


def error_body(status: int, message: str, kind: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_headers(exc: ApiError) -> dict[str, str]:
    """The headers an API error's reply carries beside its body."""
    return {**exc.headers, "Retry-After": str(RETRY_AFTER_S)} if exc.status == 429 else exc.headers


@dataclass(frozen=True)
class EdgeSettings:
    api_keys: frozenset[str]
    max_body_bytes: int
    body_timeout_s: float = 60.0
    max_inflight: int = 1024


class _FreshIds:
    """32 hex digits: a random prefix of this process and a counter. uuid4 asked the kernel for
    16 random bytes per request (a system call); a forked process draws a prefix of its own."""

    def __init__(self) -> None:
        self.reset()
        os.register_at_fork(after_in_child=self.reset)

    def reset(self) -> None:
        self._prefix = secrets.token_hex(8)
        self._counter = itertools.count()

    def __call__(self) -> str:
        return f"{self._prefix}{next(self._counter):016x}"


fresh_request_id = _FreshIds()


def request_id(headers: Mapping[str, str] | CIMultiDict[str]) -> str:
    """The client's X-Request-Id when it is a sane token (it goes into logs and upstream), else a
    fresh one: a header of any length or charset must not reach the log or a worker as is."""
    given = headers.get("X-Request-Id", "")
    return given if given and REQUEST_ID_FORMAT.fullmatch(given) else fresh_request_id()


class Admission:
    """The requests counted against ``--max-inflight``, whichever front took them; ``admitted(n)``
    is told the count whenever it changes (the metrics)."""

    def __init__(self, limit: int, admitted: Callable[[int], None] = lambda _: None) -> None:
        self.limit = limit
        self.inflight = 0
        self._admitted = admitted

    def enter(self) -> None:
        if self.inflight >= self.limit:
            message = f"the router is at its limit of {self.limit} requests in flight"
            raise ApiError(429, message, "rate_limit_error")
        self.inflight += 1
        self._admitted(self.inflight)

    def leave(self) -> None:
        self.inflight -= 1
        self._admitted(self.inflight)


def check_key(headers: Mapping[str, str] | CIMultiDict[str], path: str, settings: EdgeSettings) -> None:
    if not settings.api_keys or not path.startswith(PROTECTED_PREFIXES):
        return
    scheme, _, key = headers.get("Authorization", "").strip().partition(" ")
    # RFC 7235: the scheme is case-insensitive. Every key is compared in constant time.
    known = [hmac.compare_digest(key.strip().encode(), k.encode()) for k in settings.api_keys]
    if scheme.lower() != "bearer" or not any(known):
        message = "a valid API key is required (Authorization: Bearer <key>)"
        raise ApiError(401, message, "authentication_error", {"WWW-Authenticate": 'Bearer realm="kvroute"'})


def log_access(method: str, path: str, status: int, seconds: float, fields: dict[str, Any]) -> None:
    quiet = QUIET_PATHS | {path} if path.startswith(QUIET_PREFIXES) else QUIET_PATHS
    log_request(access_log, method, path, status, seconds, quiet, fields)


def reply_broke_off(request_id: str, exc: BaseException) -> ApiError:
    """The 502 of a worker's reply that broke off or stalled after it began, logged."""
    http_log.warning("request %s: the worker's reply did not end: %r", request_id, exc)
    return ApiError(502, "the worker's reply broke off", "upstream_error")


def internal_error(method: str, path: str, request_id: str) -> ApiError:
    """The 500 of a bug, not the client's mistake: the traceback goes to the log, once (call it
    from the ``except``), and the client is told the request id to look for."""
    error_log.exception("internal error on %s %s (request %s)", method, path, request_id)
    message = f"internal error in the router; its log has the details under request id {request_id}"
    return ApiError(500, message, "internal_error")
