"""What every request passes through: its id, the API key, OpenAI-shaped errors, the access log.

Every error the router answers has OpenAI's shape (``{"error": {"message", "type", "param",
"code"}}``), aiohttp's own 404 and 405 included. The access log is one record per request with
structured fields (one JSON object per line with ``--log-format json``); scrapes and health checks
are logged at DEBUG so that probes do not drown the requests.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from kvservice.logs import log_request

access_log = logging.getLogger("router.access")
error_log = logging.getLogger("router.errors")
REQUEST_ID: web.RequestKey[str] = web.RequestKey("request_id", str)
LOG_FIELDS: web.RequestKey[dict[str, Any]] = web.RequestKey("log_fields", dict)
QUIET_PATHS = frozenset({"/metrics", "/health", "/ready"})  # probes: logged at DEBUG
PROTECTED_PREFIXES = ("/v1/", "/debug/")
UNMATCHED = "unmatched"  # the metrics label of paths no route serves (bounded label values)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def error_response(status: int, message: str, kind: str, headers: dict[str, str] | None = None) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.json_response(body, status=status, headers=headers)


@dataclass(frozen=True)
class EdgeSettings:
    api_keys: frozenset[str]
    max_body_bytes: int


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


def _check_key(request: web.Request, settings: EdgeSettings) -> None:
    if not settings.api_keys or not request.path.startswith(PROTECTED_PREFIXES):
        return
    auth = request.headers.get("Authorization", "")
    if not auth.startswith("Bearer ") or auth[7:] not in settings.api_keys:
        raise ApiError(401, "a valid API key is required (Authorization: Bearer <key>)", "authentication_error")


def edge_middleware(settings: EdgeSettings, count: Callable[[str, int], None]) -> Any:
    """The middleware; ``count(route, status)`` is called once per request (the metrics)."""

    @web.middleware
    async def edges(request: web.Request, handler: Handler) -> web.StreamResponse:
        request[REQUEST_ID] = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        started = time.perf_counter()
        status = 500
        try:
            _check_key(request, settings)
            response = await handler(request)
            status = response.status
            return response
        except ApiError as exc:
            status = exc.status
            return error_response(exc.status, exc.message, exc.kind)
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
            count(_route_label(request), status)
            _log_access(request, status, time.perf_counter() - started)

    return edges


def _log_access(request: web.Request, status: int, seconds: float) -> None:
    fields = {"request_id": request[REQUEST_ID], **request.get(LOG_FIELDS, {})}
    log_request(access_log, request.method, request.path, status, seconds, QUIET_PATHS, fields)
