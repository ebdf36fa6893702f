"""What every request passes through: its id, the API key, the in-flight limit, the body's read
deadline, OpenAI-shaped errors, the access log.

The rules are kept here once, as plain functions and the :class:`Admission` counter, for both of
the router's HTTP fronts: aiohttp's (this module's middleware: every route) and the lean front of
the completion endpoints (:mod:`router.front`).

Every error the router answers has OpenAI's shape (``{"error": {"message", "type", "param",
"code"}}``), aiohttp's own 404 and 405 included. The access log is one record per request with
structured fields (one JSON object per line with ``--log-format json``); scrapes, health checks
and the dashboard's polls are logged at DEBUG so that probes do not drown the requests.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import os
import re
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from kvservice.logs import log_request

access_log = logging.getLogger("router.access")
error_log = logging.getLogger("router.errors")
REQUEST_ID: web.RequestKey[str] = web.RequestKey("request_id", str)
LOG_FIELDS: web.RequestKey[dict[str, Any]] = web.RequestKey("log_fields", dict)
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
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def error_body(status: int, message: str, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def error_response(status: int, message: str, kind: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(error_body(status, message, kind), status=status, headers=headers)


def error_headers(exc: ApiError) -> dict[str, str]:
    """The headers an API error's reply carries beside its body."""
    return {"Retry-After": str(RETRY_AFTER_S)} if exc.status == 429 else {}


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


def _route_label(request: web.Request) -> str:
    """The route's path pattern, never the raw path: a scanner must not create metric series."""
    info = request.match_info
    if isinstance(info, web.UrlMappingMatchInfo) and info.http_exception is None:
        return info.route.resource.canonical if info.route.resource is not None else UNMATCHED
    return UNMATCHED


def _http_error(exc: web.HTTPException, request: web.Request) -> web.Response:
    if isinstance(exc, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(exc.allowed_methods))
        message = f"{request.method} is not allowed on {request.path}; use {allowed}"
        return error_response(405, message, "invalid_request_error", {"Allow": allowed})
    if isinstance(exc, web.HTTPNotFound):
        return error_response(404, f"no such endpoint: {request.method} {request.path}", "not_found_error")
    return error_response(exc.status, exc.reason, "invalid_request_error")


def check_key(headers: Mapping[str, str] | CIMultiDict[str], path: str, settings: EdgeSettings) -> None:
    if not settings.api_keys or not path.startswith(PROTECTED_PREFIXES):
        return
    scheme, _, key = headers.get("Authorization", "").strip().partition(" ")
    # RFC 7235: the scheme is case-insensitive. Every key is compared in constant time.
    known = [hmac.compare_digest(key.strip().encode(), k.encode()) for k in settings.api_keys]
    if scheme.lower() != "bearer" or not any(known):
        raise ApiError(401, "a valid API key is required (Authorization: Bearer <key>)", "authentication_error")


async def _read_body(request: web.Request, timeout_s: float) -> None:
    """Read the whole body now, within ``timeout_s`` (the handlers' reads then return it at
    once): a client that sends half a body holds no connection and no slot beyond that."""
    if not request.body_exists:
        return
    try:
        async with asyncio.timeout(timeout_s):
            await request.read()
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout_s:g} s") from None


def edge_middleware(
    settings: EdgeSettings, count: Callable[[str, int], None], admission: Admission | None = None
) -> Any:
    """The middleware; ``count(route, status)`` is called once per request; ``admission`` counts
    the requests against ``max_inflight`` (shared with the lean front)."""
    admission = admission or Admission(settings.max_inflight)

    @web.middleware
    async def edges(request: web.Request, handler: Handler) -> web.StreamResponse:
        request[REQUEST_ID] = request_id(request.headers)
        started = time.perf_counter()
        status = 500
        counted = False
        try:
            check_key(request.headers, request.path, settings)
            if request.path.startswith(PROTECTED_PREFIXES):
                admission.enter()
                counted = True
            await _read_body(request, settings.body_timeout_s)
            response = await handler(request)
            status = response.status
            return response
        except asyncio.CancelledError:
            status = CLIENT_GONE  # the client went away (handler cancellation): not a server error
            raise
        except ApiError as exc:
            status = exc.status
            return _api_error_response(exc)
        except web.HTTPRequestEntityTooLarge:
            status = 413
            return error_response(
                413, f"the request body exceeds {settings.max_body_bytes} bytes", "invalid_request_error"
            )
        except web.HTTPException as exc:
            reply = _http_error(exc, request)
            status = reply.status
            return reply
        except Exception:
            if request.writer.output_size > 0:
                raise  # a reply was already under way: aiohttp closes the connection
            # A bug, not the client's mistake: the traceback goes to the log, once, and the
            # client gets an OpenAI-shaped 500 naming the request id to look for.
            status = 500
            error_log.exception(
                "internal error on %s %s (request %s)", request.method, request.path, request[REQUEST_ID]
            )
            message = f"internal error in the router; its log has the details under request id {request[REQUEST_ID]}"
            return error_response(500, message, "internal_error")
        finally:
            if counted:
                admission.leave()
            count(_route_label(request), status)
            fields = {"request_id": request[REQUEST_ID], **request.get(LOG_FIELDS, {})}
            log_access(request.method, request.path, status, time.perf_counter() - started, fields)

    return edges


def _api_error_response(exc: ApiError) -> web.Response:
    response = error_response(exc.status, exc.message, exc.kind, error_headers(exc))
    if exc.status == 408:
        response.force_close()  # the rest of the body is not read: the connection cannot be reused
    return response


def log_access(method: str, path: str, status: int, seconds: float, fields: dict[str, Any]) -> None:
    quiet = QUIET_PATHS | {path} if path.startswith(QUIET_PREFIXES) else QUIET_PATHS
    log_request(access_log, method, path, status, seconds, quiet, fields)
