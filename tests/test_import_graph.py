"""The ``ragkv`` package has no import cycles: its modules form a layered graph.

The graph is read from source with :mod:`ast` (nothing is imported). Its nodes are the
modules that pyproject's ``package-dir`` maps into ``ragkv``; an edge ``a → b`` is an
``import ragkv.…``, a ``from ragkv.… import …`` or a relative import in ``a`` that names
``b`` (``from pkg import mod`` names the submodule ``pkg.mod`` when there is one, else
``pkg``). What counts:

- Imports under ``if TYPE_CHECKING:`` are not edges: they never run, and exist so that
  annotations may name a type from a module above.
- Module-level imports are edges of the *import-time* graph: what Python runs when the
  module loads. A cycle there is an ordering bug waiting for the next import.
- Function-level (lazy) imports are edges of the *dependency* graph only. They keep heavy
  dependencies (torch, FastAPI) off ``import ragkv`` and ``ragkv --help``, and never break an
  import, but a cycle through one still means two modules each need the other, so neither
  can be understood, tested or moved alone. Both graphs must be acyclic.
- A module's parent packages are not edges (Python initialises them first, whatever the
  module imports), and neither are modules loaded by name at run time
  (``importlib.import_module``: the packages' lazy ``__getattr__``, ``ragkv.cli``'s
  subcommands).
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

Graph = dict[str, set[str]]


def package_modules() -> dict[str, Path]:
    """Every module of ``ragkv`` by dotted name, found through pyproject's ``package-dir``."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    modules: dict[str, Path] = {}
    for package, folder in setuptools["package-dir"].items():
        for source in (ROOT / folder).rglob("*.py"):
            parts = source.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = source
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(
    node: ast.AST, lazy: bool = False
) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Each import statement under ``node`` with whether it runs only when a function is
    called; the body of ``if TYPE_CHECKING:`` is skipped (its ``else`` is not)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, lazy
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for statement in child.orelse:
                yield from _imports(ast.Module(body=[statement], type_ignores=[]), lazy)
        else:
            function = isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            yield from _imports(child, lazy or function)


def _target(name: str, modules: dict[str, Path]) -> str | None:
    """The ragkv module ``name`` loads: itself, or the nearest enclosing package."""
    while name not in modules and "." in name:
        name = name.rsplit(".", 1)[0]
    return name if name in modules else None


def _base(module: str, statement: ast.ImportFrom, modules: dict[str, Path]) -> str:
    """The absolute module a ``from … import`` reads from (relative imports resolved)."""
    if not statement.level:
        return statement.module or ""
    package = module.split(".")
    if modules[module].name != "__init__.py":
        package = package[:-1]
    package = package[: len(package) - (statement.level - 1)]
    return ".".join([*package, *([statement.module] if statement.module else [])])


def import_graphs() -> tuple[Graph, Graph]:
    """``(import_time, dependency)``: module-level edges only, and all edges."""
    modules = package_modules()
    import_time: Graph = {m: set() for m in modules}
    dependency: Graph = {m: set() for m in modules}
    for module, source in modules.items():
        for statement, lazy in _imports(ast.parse(source.read_text(), str(source))):
            if isinstance(statement, ast.Import):
                names = [alias.name for alias in statement.names]
            else:
                base = _base(module, statement, modules)
                names = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    for alias in statement.names
                ]
            for name in names:
                target = _target(name, modules)
                if target is None or target == module:
                    continue
                dependency[module].add(target)
                if not lazy:
                    import_time[module].add(target)
    return import_time, dependency


def cycles(graph: Graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
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
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


@pytest.fixture(scope="module")
def graphs() -> tuple[Graph, Graph]:
    return import_graphs()


def test_the_graph_sees_the_whole_package(graphs):
    import_time, dependency = graphs
    assert "ragkv.integrations.openai.server.cli" in dependency
    assert "ragkv.cache_engine.block_pool" in import_time["ragkv.cache_engine"]
    assert "ragkv.errors" in import_time["ragkv.cache_engine.engine_calls"]


def test_the_server_cli_is_the_top_of_the_server(graphs):
    _, dependency = graphs
    cli = "ragkv.integrations.openai.server.cli"
    assert [m for m, targets in dependency.items() if cli in targets] == []


def test_no_import_cycle_at_import_time(graphs):
    import_time, _ = graphs
    assert cycles(import_time) == []


def test_no_dependency_cycle_through_lazy_imports(graphs):
    _, dependency = graphs
    assert cycles(dependency) == []


def test_cycles_are_found_when_there_are_some():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_type_checking_imports_are_not_edges():
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import ragkv.a\nelse:\n    import ragkv.b\n"
        "def f():\n    import ragkv.c\n"
    )
    seen = {
        (s.names[0].name, lazy) for s, lazy in _imports(tree) if s.names[0].name != "TYPE_CHECKING"
    }
    assert seen == {("ragkv.b", False), ("ragkv.c", True)}
