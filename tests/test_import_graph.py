"""The package's own import graph: no circle between files or between packages, the embedded server a leaf,
the planner/cost/control blind to the simulator, and imports inside functions kept for heavy optional
dependencies only (issue 22)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "areal_libra"
MAX_INSIDE_FUNCTIONS = 0.20


def _module(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p): p for p in PKG.rglob("*.py")}


def _resolve(name: str) -> str:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _imports(module: str) -> list[tuple[str, bool]]:
    """(imported module of this package, inside a function?) for each import statement's targets."""
    path = MODULES[module]
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, inside: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = inside or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((_resolve(a.name), inside) for a in child.names if a.name.startswith("areal_libra"))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                    base = base[: len(base) - child.level + 1]
                    name = ".".join(base + ([child.module] if child.module else []))
                else:
                    name = child.module or ""
                if name.startswith("areal_libra"):
                    targets = {_resolve(f"{name}.{a.name}") for a in child.names}
                    found.extend((t, inside) for t in targets)
            visit(child, nested)

    visit(ast.parse(path.read_text(encoding="utf-8")), False)
    return [(m, inside) for m, inside in found if m and m != module]


GRAPH = {m: _imports(m) for m in MODULES}


def _package(module: str) -> str:
    """areal_libra.rollout.fleet -> rollout; a top-level module (areal_libra.config) is its own node."""
    return module.split(".")[1] if module.count(".") else module


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            strong(v)
    return out


def _package_of_init(module: str, target: str) -> bool:
    """A module importing its own package's __init__ (or the reverse) is not a circle between files."""
    return module.startswith(target + ".") or target.startswith(module + ".")


def test_no_import_circle_between_files() -> None:
    edges = {m: {t for t, _ in imps if not _package_of_init(m, t)} for m, imps in GRAPH.items()}
    assert _cycles(edges) == []


def test_no_import_circle_between_packages() -> None:
    edges: dict[str, set[str]] = {}
    for m, imps in GRAPH.items():
        for t, _ in imps:
            if _package(t) != _package(m):
                edges.setdefault(_package(m), set()).add(_package(t))
    assert _cycles(edges) == []


@pytest.mark.parametrize(("package", "forbidden"), [
    ("server", ("rollout", "live")),
    ("planner", ("sim",)),
    ("cost", ("sim",)),
    ("control", ("sim",)),
    ("cmlfq", ("sim",)),
])
def test_layering(package: str, forbidden: tuple[str, ...]) -> None:
    bad = sorted(f"{m} -> {t}" for m, imps in GRAPH.items() if _package(m) == package
                 for t, _ in imps if _package(t) in forbidden)
    assert bad == []


def test_imports_inside_functions_are_the_exception() -> None:
    statements = [inside for imps in GRAPH.values() for _, inside in imps]
    share = sum(statements) / len(statements)
    assert share <= MAX_INSIDE_FUNCTIONS, f"{share:.0%} of the package's imports of itself are inside functions"


def test_the_graph_is_read() -> None:
    # the checks above are vacuous if the parser finds nothing: the trainer process imports the router
    assert "areal_libra.rollout.router" in {t for t, _ in GRAPH["areal_libra.live.train"]}
