"""The route table: each path the router serves, its methods and their handlers.

Paths are matched exactly (the router has no path parameters). A HEAD request is served by the
GET handler, its body dropped. What no route serves is a 404 and a method the path does not take a
405 naming those it does, both in OpenAI's error shape (:mod:`router.http.server`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from router.http.edges import ApiError
from router.http.wire import Handler


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    handler: Handler


@dataclass
class Routes:
    """Handlers by path and method."""

    _table: dict[str, dict[str, Handler]] = field(default_factory=dict)

    def add(self, method: str, path: str, handler: Handler) -> None:
        methods = self._table.setdefault(path, {})
        if method in methods:
            raise ValueError(f"{method} {path} has a handler already")
        methods[method] = handler

    def get(self, path: str, handler: Handler) -> None:
        self.add("GET", path, handler)

    def post(self, path: str, handler: Handler) -> None:
        self.add("POST", path, handler)

    def __iter__(self) -> Iterator[Route]:
        for path, methods in self._table.items():
            for method, handler in methods.items():
                yield Route(method, path, handler)

    def find(self, method: str, path: str) -> Handler:
        """The handler of ``method`` on ``path``; ApiError 404, or 405 with an ``Allow`` header,
        when there is none."""
        methods = self._table.get(path)
        if methods is None:
            raise ApiError(404, f"no such endpoint: {method} {path}", "not_found_error")
        handler = methods.get("GET" if method == "HEAD" else method)
        if handler is None:
            allowed = ", ".join(sorted({*methods, "HEAD"} if "GET" in methods else methods))
            raise ApiError(405, f"{method} is not allowed on {path}; use {allowed}", headers={"Allow": allowed})
        return handler
