"""One logging set-up for every long-running command: ``--log-level`` and ``--log-format``.

``text`` is for people (one line: time, level, logger, message, then ``key=value`` fields);
``json`` is one JSON object per line for log pipelines. Structured fields travel as
``extra={"fields": {...}}`` and become top-level keys of the JSON object.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from kvservice.declared import setting

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
FORMATS = ("text", "json")
FIELDS = "fields"  # the ``extra`` key that carries structured fields


@dataclass(frozen=True)
class LogSettings:
    level: str = setting(
        "INFO",
        flag="--log-level",
        parse=lambda _, value: value.strip().upper(),
        choices=LEVELS,
        group="logging",
        help="the least level logged",
    )
    format: str = setting(
        "text",
        flag="--log-format",
        parse=lambda _, value: value.strip().lower(),
        choices=FORMATS,
        group="logging",
        help="text (for people) or json (one JSON object per line, for log pipelines)",
    )

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"--log-level must be one of {', '.join(LEVELS)}, not {self.level!r}")
        if self.format not in FORMATS:
            raise ValueError(f"--log-format must be one of {', '.join(FORMATS)}, not {self.format!r}")


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields = getattr(record, FIELDS, None)
    return fields if isinstance(fields, dict) else {}


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = _fields(record)
        if not fields:
            return line
        return line + " " + " ".join(f"{key}={_text_value(value)}" for key, value in fields.items())


def _text_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return json.dumps(text) if (not text or " " in text or '"' in text) else text


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts`` (RFC 3339, UTC), ``level``, ``logger``, ``message``, the
    record's fields, and ``exception`` when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        created = time.gmtime(record.created)
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", created) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update(_fields(record))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def log_request(
    logger: logging.Logger,
    method: str,
    path: str,
    status: int,
    seconds: float,
    quiet_paths: frozenset[str],
    fields: dict[str, Any] | None = None,
) -> None:
    """One access-log record: ``METHOD path status`` with method, path, status, ms and ``fields``
    as structured fields; at DEBUG for ``quiet_paths`` (probes and scrapes), else INFO."""
    level = logging.DEBUG if path in quiet_paths else logging.INFO
    if not logger.isEnabledFor(level):
        return
    record = {"method": method, "path": path, "status": status, "ms": round(1000 * seconds, 2), **(fields or {})}
    logger.log(level, "%s %s %d", method, path, status, extra={FIELDS: record})


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def access_log_middleware(logger: logging.Logger, quiet_paths: frozenset[str]) -> Any:
    """An aiohttp middleware writing one :func:`log_request` record per request, with the status
    it ended with: an HTTPException's, 499 when the client went away (nginx's code), else 500."""

    @web.middleware
    async def access_log(request: web.Request, handler: Handler) -> web.StreamResponse:
        started = time.perf_counter()
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        except (asyncio.CancelledError, ConnectionResetError):
            status = 499
            raise
        finally:
            log_request(logger, request.method, request.path, status, time.perf_counter() - started, quiet_paths)

    return access_log


def configure_logging(settings: LogSettings) -> None:
    """Replace the root handlers with one stderr handler in the chosen format."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if settings.format == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(settings.level)
    # aiohttp logs every request at INFO through its own access logger; ours replaces it.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
