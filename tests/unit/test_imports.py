"""The import graph, read from the source: no module imports itself back through others, and the
packages import in one direction (README, "Layout"): ``router -> kvindex <- worker_agent``, with
``kvservice`` (process plumbing), ``kvtokens`` (tokenizers and chat templates) and ``kvevents``
(the engines' KV-event wire schemas) below everything, and the simulated engine importing neither
the router nor the agent nor the index.

Imports under ``if TYPE_CHECKING:`` are left out: they never run."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support import ROOT

PACKAGES = ("kvevents", "kvindex", "kvservice", "kvtokens", "router", "worker_agent", "sim_engine", "kvroute")
# What each package may import of the others (kvroute is the command line and the dev tools: any).
ALLOWED = {
    "kvservice": set(),
    "kvtokens": set(),
    "kvevents": set(),
    "kvindex": {"kvservice"},
    "router": {"kvindex", "kvservice", "kvtokens"},
    "worker_agent": {"kvevents", "kvindex", "kvservice", "kvtokens"},
    "sim_engine": {"kvevents", "kvservice", "kvtokens"},
    "kvroute": set(PACKAGES),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _runtime_imports(tree: ast.Module, module: str, is_package: bool) -> set[str]:
    """The modules ``module`` imports when it runs (TYPE_CHECKING blocks left out)."""
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
                continue
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = module.split(".")
                    anchor = anchor if is_package else anchor[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, *([base] if base else [])])
                found.add(base)
                found.update(f"{base}.{alias.name}" for alias in node.names)
            for field in ("body", "orelse", "finalbody", "handlers"):
                inner = getattr(node, field, None)
                if isinstance(inner, list) and inner and isinstance(inner[0], ast.stmt | ast.ExceptHandler):
                    visit(
                        [n for n in inner if isinstance(n, ast.stmt)]
                        + [s for h in inner if isinstance(h, ast.ExceptHandler) for s in h.body]
                    )

    visit(tree.body)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the project's modules it imports at run time."""
    sources = {
        _module_name(path): path
        for package in PACKAGES
        if (ROOT / package).is_dir()
        for path in (ROOT / package).rglob("*.py")
    }
    graph: dict[str, set[str]] = {}
    for module, path in sources.items():
        imported = _runtime_imports(ast.parse(path.read_text()), module, path.name == "__init__.py")
        graph[module] = {name for name in imported if name in sources and name != module}
    return graph


def test_no_module_imports_itself_back() -> None:
    graph = import_graph()
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def walk(module: str) -> None:
        state[module] = 1
        path.append(module)
        for other in sorted(graph[module]):
            if state.get(other) == 1:
                cycles.append([*path[path.index(other) :], other])
            elif other not in state:
                walk(other)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            walk(module)
    assert cycles == []


def test_packages_import_in_one_direction() -> None:
    wrong = sorted(
        f"{module} imports {other}"
        for module, imported in import_graph().items()
        for other in imported
        if (a := module.split(".")[0]) != (b := other.split(".")[0]) and b not in ALLOWED[a]
    )
    assert wrong == []


# Within a package: what a part must not import (the dev stack is below the benchmarks that use it).
FORBIDDEN_WITHIN = {"kvroute.devstack": ("kvroute.bench", "kvroute.cli"), "router.http": ("router.app",)}


def test_parts_of_a_package_import_in_one_direction() -> None:
    wrong = sorted(
        f"{module} imports {other}"
        for module, imported in import_graph().items()
        for part, forbidden in FORBIDDEN_WITHIN.items()
        if module.startswith(part + ".") or module == part
        for other in imported
        if other.startswith(forbidden)
    )
    assert wrong == []


# The router's rooms, lowest first: each imports only rooms before it (and of router's own top
# level only its settings); the top level (main, app, completions, state) assembles them.
ROUTER_ROOMS = ("router.prompts", "router.shared", "router.routing", "router.upstream", "router.http", "router.observe")
ROOM_MAY_IMPORT_TOP = ("router.settings",)


def test_the_routers_rooms_import_downwards() -> None:
    def room(module: str) -> str | None:
        return next((r for r in ROUTER_ROOMS if module == r or module.startswith(r + ".")), None)

    wrong = []
    for module, imported in import_graph().items():
        here = room(module)
        if here is None:
            continue
        below = ROUTER_ROOMS[: ROUTER_ROOMS.index(here) + 1]
        for other in imported:
            if other.startswith("router") and room(other) not in below and other not in ROOM_MAY_IMPORT_TOP:
                wrong.append(f"{module} imports {other}")
    assert sorted(wrong) == []


def test_the_graph_is_read_at_all() -> None:
    graph = import_graph()
    assert "kvindex.routing_index" in graph["router.routing.decide"]  # a test that could not see imports would pass
    assert "kvroute.devstack.processes" in graph["kvroute.bench.router"]
    assert len(graph) > 100


def test_the_router_reaches_redis_through_its_port_only() -> None:
    """The router is typed on the routing port (kvindex.routing_index); which backend it runs on
    (the Redis index and its scripts, or the reference in memory) is chosen where it is built."""
    backends = {"kvindex.redis_index", "kvindex.redis_routing", "kvindex.scripts", "kvindex.calls"}
    wrong = [
        f"{module} imports {sorted(imported & backends)}"
        for module, imported in import_graph().items()
        if module.startswith("router.") and module != "router.main" and imported & backends
    ]
    assert wrong == []
