"""The import graph of refengine/, kernels/ and conformance/ has no circles, and the layers import downward.

Every ``import`` and ``from ... import`` statement counts, those inside functions included (a lazy import
still ties the two modules together), except those under ``if TYPE_CHECKING:`` (never run). An edge goes
from a module to the module it names:

- ``from a.b import c`` names ``a.b.c`` when that is a module (a submodule imported through its package's
  syntax, the classic false positive of a package whose ``__init__`` imports its submodules), else ``a.b``
  (a name its ``__init__`` defines);
- importing ``a.b.c`` also runs the ``__init__`` of ``a`` and of ``a.b``: those are edges too, except to a
  package the importing module is itself inside (it is already being imported when the module runs, so a
  module of ``a.b`` importing its sibling ``a.b.d`` adds no edge to ``a.b``).

A circle is a strongly connected component of more than one module (or a module importing itself).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("refengine", "kernels", "conformance")

# Circles being taken apart elsewhere, each named by its modules, sorted; a circle listed here that no longer
# exists fails the test too, so the list cannot go stale. bench <-> host_bench: `refengine bench --fake-cuda`
# hands over to host_bench, which takes bench's workload back (``_workload`` belongs in a module of its own).
KNOWN: set[tuple[str, ...]] = set()

ADAPTERS = "conformance.adapters"
BUILTIN_ADAPTERS = {ADAPTERS, f"{ADAPTERS}.refengine"}  # refengine's own engines; the rest: outside engines
OUTSIDE_ENGINE_PACKAGES = ("vllm",)  # the outside engines' own packages, imported only by their adapters


def module_files(root: Path, packages: Iterable[str] = PACKAGES) -> dict[str, Path]:
    """Module name -> file, for every ``.py`` file under ``root/<package>``."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _is_package(name: str, files: dict[str, Path]) -> bool:
    return name in files and files[name].name == "__init__.py"


def _import_statements(body: list[ast.stmt]):
    """The import statements of a block and of every block inside it (functions, classes, branches, loops,
    ``with``, ``try`` and ``match``), expressions not entered; blocks under ``if TYPE_CHECKING:`` skipped."""
    for stmt in body:
        if isinstance(stmt, ast.Import | ast.ImportFrom):
            yield stmt
            continue
        if isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(stmt.test):
            yield from _import_statements(stmt.orelse)
            continue
        for field in ("body", "orelse", "finalbody"):
            yield from _import_statements(getattr(stmt, field, []))
        for part in (*getattr(stmt, "handlers", ()), *getattr(stmt, "cases", ())):  # except / case blocks
            yield from _import_statements(part.body)


def imported_names(name: str, path: Path, files: dict[str, Path]) -> set[str]:
    """Every dotted name module ``name`` imports (absolute; ``from a import b`` as ``a.b`` if that is a
    module, else ``a``)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if _is_package(name, files) else name.rpartition(".")[0]
    names = set()
    for node in _import_statements(tree.body):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            base = ".".join([*anchor, base] if base else anchor)
        for alias in node.names:
            full = f"{base}.{alias.name}"
            names.add(full if full in files else base)
    return names


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def read_imports(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> tuple[dict, dict[str, set[str]]]:
    """(module -> file, module -> the dotted names it imports), every file parsed once."""
    files = module_files(root, packages)
    return files, {name: imported_names(name, path, files) for name, path in files.items()}


def import_graph(files: dict[str, Path], imports: dict[str, set[str]]) -> dict[str, set[str]]:
    """Module -> the modules of ``files`` it imports (the rule in the module docstring)."""
    graph: dict[str, set[str]] = {}
    for name in files:
        own = {*_ancestors(name), *([name] if _is_package(name, files) else [])}
        edges = set()
        for target in imports[name]:
            while target and target not in files:  # ``import a.b.name`` of a non-module: the module above
                target = target.rpartition(".")[0]
            if not target:
                continue  # not one of ours
            edges.add(target)
            edges.update(p for p in _ancestors(target) if p in files and p not in own)
        if name in own:  # a package's ``__init__`` naming the package itself
            edges.discard(name)
        graph[name] = edges
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, or of a module importing itself (Tarjan's
    algorithm, iterative), each as its sorted modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph[node]:
                    found.append(sorted(component))
    return found


def _cycle_through(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """One cycle from the component's first module back to itself (breadth first, inside the component)."""
    start, inside = component[0], set(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & inside):
                if nxt == start:
                    return [*paths[node], start]
                if nxt not in paths:
                    paths[nxt] = [*paths[node], nxt]
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"no cycle through {start} in its component {component}")


def describe(component: list[str], graph: dict[str, set[str]]) -> str:
    """A circle in words: its modules, and one cycle through the first of them."""
    return f"{', '.join(component)}: {' -> '.join(_cycle_through(component, graph))}"


@pytest.fixture(scope="module")
def parsed():
    return read_imports()


def test_no_import_circles(parsed):
    graph = import_graph(*parsed)
    found = {tuple(c): c for c in circles(graph)}
    new = [describe(c, graph) for k, c in found.items() if k not in KNOWN]
    assert not new, "import circle(s):\n" + "\n".join(new)
    gone = KNOWN - set(found)
    assert not gone, f"listed in KNOWN but no longer a circle (remove them): {sorted(gone)}"


def test_core_modules_never_import_the_tools(parsed):
    """refengine's tools (command lines, tiny models, training) sit on top of the engine: a core module
    gets a tiny model's folder or head as an argument, never by importing them."""
    _, imports = parsed
    wrong = sorted(f"{name} imports {target}" for name, targets in imports.items()
                   if name.startswith("refengine.") and not name.startswith("refengine.tools")
                   for target in targets
                   if target == "refengine.tools" or target.startswith("refengine.tools."))
    assert not wrong, "\n".join(wrong)


def test_the_engine_takes_folders_and_names_the_tool_for_a_tiny_model():
    """``LLM("tiny:...")`` built a tiny model (``LLM("tiny:eagle3")`` a second LLM, to train its head) inside
    the engine; now the loader and the EAGLE drafter refuse the name in one line naming the tool to call."""
    from refengine import LLM
    from refengine.drafters.eagle import resolve_head_path
    from refengine.model.loader import CheckpointError, resolve_model_path

    with pytest.raises(CheckpointError, match=r"^model='tiny:nemotron_h' is a tiny model's name, not a "
                       r"folder: pass refengine\.tools\.tiny_models\.tiny_model_path\('tiny:nemotron_h'\)"):
        resolve_model_path("tiny:nemotron_h")
    with pytest.raises(CheckpointError, match=r"^draft_model='tiny:nemotron_h' is a tiny model's name"):
        LLM(drafter="draft_model", num_speculative_tokens=2, draft_model="tiny:nemotron_h")  # before any load
    with pytest.raises(ValueError, match=r"draft_model='tiny:eagle3' .*tiny_models\.tiny_head_path"):
        resolve_head_path("tiny:eagle3")
    assert resolve_head_path("/some/head") == "/some/head"


def test_outside_engines_stay_in_their_adapters(parsed):
    """An outside engine's adapter (conformance/adapters/<engine>.py) is loaded by name only: no module
    outside conformance/adapters/ imports one, and only that folder imports an outside engine's package."""
    _, imports = parsed
    wrong = []
    for name, targets in imports.items():
        if name == ADAPTERS or name.startswith(ADAPTERS + "."):
            continue
        for target in targets:
            if target.startswith(ADAPTERS + ".") and target not in BUILTIN_ADAPTERS:
                wrong.append(f"{name} imports the outside-engine adapter {target}")
            if target.split(".")[0] in OUTSIDE_ENGINE_PACKAGES:
                wrong.append(f"{name} imports {target}")
    assert not wrong, "\n".join(wrong)


def test_no_module_imports_what_only_an_extra_installs(parsed):
    """A plain ``pip install .`` runs every command (tests/test_plain_install.py installs one): no import
    statement, lazy ones included, names a module that only the package's extras bring (pytest-xdist,
    junitparser, ruff, ...; pytest and hypothesis are dependencies, the suite and fuzz run on them)."""
    from tests.test_plain_install import extras_only_modules

    extras = set(extras_only_modules())
    assert {"xdist", "junitparser"} <= extras, extras
    _, imports = parsed
    wrong = sorted(f"{name} imports {target}" for name, targets in imports.items() for target in targets
                   if target.split(".")[0] in extras)
    assert not wrong, "only an extra installs these:\n" + "\n".join(wrong)


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_a_planted_circle_is_found_and_a_package_reexporting_its_submodules_is_not(tmp_path):
    """The rules on a small tree: a lazy import inside a function closing a circle is one; a package whose
    ``__init__`` imports its submodules, which import each other through the package's syntax, is not; a
    submodule importing a name its package's ``__init__`` defines while that ``__init__`` imports it is."""
    _write(tmp_path, {
        "p/__init__.py": "from p.a import A\nfrom p.b import B\n",
        "p/a.py": "from p import b\nA = 1\n",
        "p/b.py": "from . import c\nB = 2\n",
        "p/c.py": "def f():\n    from p.d import D\n",
        "p/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.c import f\nD = 3\n",
        "q/__init__.py": "from q.mid import X\nY = 1\n",
        "q/mid.py": "from q import Y\nX = 2\n",
        "r/x.py": "import r.y\n",
        "r/y.py": "def g():\n    from r import x\n",
        "r/__init__.py": "",
    })
    graph = import_graph(*read_imports(tmp_path, ("p", "q", "r")))
    assert circles(graph) == [["q", "q.mid"], ["r.x", "r.y"]]
    assert graph["p.a"] == {"p.b"} and graph["p.c"] == {"p.d"} and graph["p.d"] == set()
    assert describe(["r.x", "r.y"], graph) == "r.x, r.y: r.x -> r.y -> r.x"
