"""The ``usage`` object of a worker's reply, read as the reply passes through the proxy: from a
whole JSON reply, or from a server-sent event stream's events as they come."""

from __future__ import annotations

import json


def usage_from_json(body: bytes) -> dict | None:
    try:
        usage = json.loads(body).get("usage")
    except (ValueError, AttributeError):
        return None
    return usage if isinstance(usage, dict) else None


class SseUsage:
    """Finds the usage object in a server-sent event stream as it passes through."""

    def __init__(self) -> None:
        self._tail = b""
        self.usage: dict | None = None

    def feed(self, chunk: bytes) -> None:
        data = self._tail + chunk
        *events, self._tail = data.split(b"\n\n")
        for event in events:
            if b'"usage"' in event:
                for line in event.splitlines():
                    if line.startswith(b"data:"):
                        found = usage_from_json(line[5:].strip())
                        if found:
                            self.usage = found
        if len(self._tail) > 1 << 20:
            self._tail = b""
