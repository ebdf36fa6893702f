"""An aiohttp runner whose malformed requests (a bad chunk, a NUL in a header, a head over the
parser's limits) get a 400 in OpenAI's error shape and one log line, for the aiohttp servers of
the simulated engine and the agent (the router has its own server: router/http/server.py).

aiohttp answers them itself, before any handler or middleware runs: a text/plain
``HTTP/1.0 400`` that echoes the client's bytes, and an ERROR with a full traceback in the log
(a client's mistake is not the server's error). Its per-connection ``RequestHandler`` has no
public hook for that, so the runner's server makes handlers of a subclass that answers them
(its ``handle_error``). A 500 is aiohttp's own: a bug keeps its traceback.
"""

from __future__ import annotations

import logging

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

log = logging.getLogger("kvservice.http")
ERROR_TYPES = {400: "BadRequestError", 413: "RequestTooLarge", 431: "RequestHeaderFieldsTooLarge"}


def malformed_reason(exc: BaseException | None) -> str:
    """What was wrong, in one line and without the client's bytes (aiohttp's message quotes them)."""
    if isinstance(exc, HttpProcessingError) and exc.message:
        return " ".join(str(exc.message).split(":")[0].split())[:200]
    return "the request could not be parsed"


class _OpenAIErrorsHandler(RequestHandler):
    def handle_error(
        self, request: BaseRequest, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        if status >= 500 or request.writer.output_size > 0:
            return super().handle_error(request, status, exc, message)
        reason = malformed_reason(exc)
        log.info("refused a malformed HTTP request from %s (%d): %s", request.remote, status, reason)
        kind = ERROR_TYPES.get(status, "BadRequestError")
        body = {"error": {"message": f"malformed HTTP request: {reason}", "type": kind, "param": None, "code": status}}
        response = web.json_response(body, status=status)
        response.force_close()
        return response


class _OpenAIErrorsServer(web.Server):
    __slots__ = ()  # the same layout as web.Server's: its instances take this class in place

    def __call__(self) -> RequestHandler:
        return _OpenAIErrorsHandler(self, loop=self._loop, **self._kwargs)


class OpenAIErrorsRunner(web.AppRunner):
    """``web.AppRunner`` whose connections answer malformed HTTP in OpenAI's error shape."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _OpenAIErrorsServer
        return server
