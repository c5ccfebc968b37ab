"""The package's import graph: arrows point one way, and no package reaches into another's privates.

Built from the source with `ast`: an edge for every import a module runs when it is loaded (its
top level, including `try` and `if` blocks, but not `if TYPE_CHECKING:`, functions or classes);
a second graph adds the imports deferred into functions, since a cycle hidden there is still one.
Run it alone with `python -m pytest tests/test_import_graph.py`.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import hf_specdec

PACKAGE = Path(hf_specdec.__file__).resolve().parent
ROOT = PACKAGE.name

# (importing module, module imported from, name): private names one package may take from another.
# None: prompt encoding and model loading have their public home in `hf_specdec/loading.py`.
ALLOWED_PRIVATE: set[tuple[str, str, str]] = set()


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the package (a package is its `__init__.py`)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _load_time_imports(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    """The import statements that run when a module is loaded."""
    found: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If):
            found += _load_time_imports(node.orelse)
            if not _is_type_checking(node.test):
                found += _load_time_imports(node.body)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                found += _load_time_imports(block)
        elif isinstance(node, ast.With):
            found += _load_time_imports(node.body)
    return found


def _all_imports(node: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, in functions as well, except under `if TYPE_CHECKING:`."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return [node]
    if isinstance(node, ast.If) and _is_type_checking(node.test):
        return [found for child in node.orelse for found in _all_imports(child)]
    return [found for child in ast.iter_child_nodes(node) for found in _all_imports(child)]


def _source(module: str, node: ast.ImportFrom) -> str:
    """The absolute name of the module an `from ... import` reads from."""
    if node.level == 0:
        return node.module or ""
    package = module if _is_package(module) else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> list[tuple[str, str | None]]:
    """(our module imported, name taken from it or None) for one import statement."""
    if isinstance(node, ast.Import):
        return [(alias.name, None) for alias in node.names if alias.name in MODULES]
    source = _source(module, node)
    if source not in MODULES:
        return []
    targets = []
    for alias in node.names:
        submodule = f"{source}.{alias.name}"
        targets.append((submodule, None) if submodule in MODULES else (source, alias.name))
    return targets


def _trees() -> dict[str, ast.Module]:
    return {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def import_graph(deferred: bool = False) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports when loaded (and, if `deferred`, in its functions)."""
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for module, tree in _trees().items():
        for node in _all_imports(tree) if deferred else _load_time_imports(tree.body):
            graph[module] |= {target for target, _ in _targets(module, node) if target != module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None."""
    state: dict[str, str] = {}  # "open" while on the DFS path, "done" once fully explored
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def _subpackage(module: str) -> str:
    return module if _is_package(module) else module.rpartition(".")[0]


@pytest.mark.parametrize("deferred", [False, True], ids=["load-time", "with-deferred"])
def test_the_package_has_no_import_cycles(deferred):
    cycle = find_cycle(import_graph(deferred))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_check_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_package_imports_another_packages_private_names():
    taken = set()
    for module, tree in _trees().items():
        for node in _all_imports(tree):  # in functions as well
            for target, name in _targets(module, node):
                private = name is not None and name.startswith("_") and not name.startswith("__")
                if private and _subpackage(target) != _subpackage(module):
                    taken.add((module, target, name))
    assert taken <= ALLOWED_PRIVATE, (
        f"private names imported across packages: {sorted(taken - ALLOWED_PRIVATE)}"
    )
    assert taken >= ALLOWED_PRIVATE, (
        f"no longer imported, drop from ALLOWED_PRIVATE: {ALLOWED_PRIVATE - taken}"
    )


def test_importing_the_policy_does_not_load_the_drafters():
    """`hf_specdec/__init__.py` loads the drafters for its public API, so the package is stubbed:
    what is checked is what `policy.py` itself pulls in."""
    code = (
        "import sys, types\n"
        f"package = types.ModuleType({ROOT!r}); package.__path__ = [{str(PACKAGE)!r}]\n"
        f"sys.modules[{ROOT!r}] = package\n"
        f"import {ROOT}.policy\n"
        f"print(sorted(m for m in sys.modules if m.startswith({ROOT + '.'!r})))\n"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert f"{ROOT}.policy" in loaded
    assert f"{ROOT}.drafters" not in loaded, loaded
