"""refengine.tools imports no module that imports it back: read from the source, every ``import`` counted,
those inside functions too (a lazy import hides a circle from Python, not from the reader)."""

from __future__ import annotations

import ast
from pathlib import Path

import refengine.tools

TOOLS = Path(refengine.tools.__file__).resolve().parent
PACKAGE = "refengine.tools"


def _tool_modules() -> dict[str, Path]:
    return {f"{PACKAGE}.{p.stem}": p for p in sorted(TOOLS.glob("*.py")) if p.stem != "__init__"}


def _imported(path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that the file at ``path`` imports, anywhere in it."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)  # ``from refengine.tools import x``
    return found & known


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle of ``graph`` (module -> the modules it imports) as a path, [] when there is none."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" once every edge out is explored
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = "done"
        return []

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return []


def test_the_graph_reader_finds_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_refengine_tools_has_no_import_circle():
    modules = _tool_modules()
    graph = {name: _imported(path, set(modules)) - {name} for name, path in modules.items()}
    assert f"{PACKAGE}.cli" in graph, "the reader found no tools modules"
    assert f"{PACKAGE}.bench" in graph[f"{PACKAGE}.cli"], "the reader misses cli's import of bench"
    circle = _cycle(graph)
    assert circle == [], "import circle: " + " -> ".join(circle)
