"""The layout docs/architecture.md draws, checked from the source: no import circle anywhere in
the package or the benchmarks, counting every import (at the top, inside functions, under
``TYPE_CHECKING``) and the package ``__init__`` each import runs; the cluster mode never
reaches into the server; the benchmark machinery is not in the package."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def modules(top: Path) -> dict[str, Path]:
    found = {}
    for path in top.rglob("*.py"):
        parts = list(path.relative_to(top.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def import_graph(top: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same tree that importing it runs (an import of
    ``a.b.c`` runs ``a/__init__``, ``a/b/__init__`` and ``a.b.c``)."""
    mods = modules(top)
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                wanted = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = name.split(".")
                    keep = len(parts) - node.level + (1 if is_package else 0)
                    base = ".".join([*parts[:keep], *([node.module] if node.module else [])])
                wanted = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            else:
                continue
            for target in wanted:
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                parts = target.split(".")
                for i in range(1, len(parts) + 1):  # the packages the import runs on its way
                    reached = ".".join(parts[:i])
                    if reached in mods and reached != name and not name.startswith(reached + "."):
                        graph[name].add(reached)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


@pytest.mark.parametrize("tree", ["src/seedance", "benchmarks"])
def test_no_import_circle(tree: str) -> None:
    graph = import_graph(ROOT / tree)
    assert len(graph) > 5  # the walk found the modules
    assert circles(graph) == []


def test_the_checker_sees_the_circles_it_is_for(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from pkg.sub import a\n")
    (package / "sub" / "a.py").write_text("def f():\n    from pkg import b\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.sub.a import f\n"
    )
    (package / "c.py").write_text("import pkg.sub.a\n")  # runs pkg/sub/__init__ too
    assert circles(import_graph(package)) == [["pkg.b", "pkg.sub", "pkg.sub.a"]]
    (package / "sub" / "a.py").write_text("from . import other\n")
    (package / "sub" / "other.py").write_text("import pkg.c\n")
    assert circles(import_graph(package)) == [["pkg.c", "pkg.sub", "pkg.sub.a", "pkg.sub.other"]]


def test_the_cluster_mode_imports_nothing_of_the_server() -> None:
    graph = import_graph(ROOT / "src/seedance")
    reaching = {
        (name, target)
        for name, targets in graph.items()
        if name.startswith("seedance.cluster")
        for target in targets
        if target.startswith("seedance.server")
    }
    assert reaching == set()


def test_the_benchmark_machinery_is_beside_the_package() -> None:
    """``seedance bench`` (the load generator) is in the wheel; ``make bench``'s suites, peers,
    builders, compare and soak are in ``benchmarks/``, and nothing in the package imports
    them."""
    inside = {p.stem for p in (ROOT / "src/seedance/bench").glob("*.py")}
    assert inside == {"__init__", "cli", "load", "metrics", "report", "targets"}
    for path in (ROOT / "src/seedance").rglob("*.py"):
        assert "import benchmarks" not in path.read_text() and "from benchmarks" not in (
            path.read_text()
        ), path
