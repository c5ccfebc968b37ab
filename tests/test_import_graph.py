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


def _all_imports(node: ast.AST, type_hints: bool = False) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, in functions as well; under `if TYPE_CHECKING:` only if `type_hints`."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return [node]
    if isinstance(node, ast.If) and _is_type_checking(node.test) and not type_hints:
        return [found for child in node.orelse for found in _all_imports(child)]
    return [found for child in ast.iter_child_nodes(node) for found in _all_imports(child, type_hints)]


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


def import_graph(deferred: bool = False, type_hints: bool = False) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports when loaded (and, if `deferred`, in its functions;
    if `type_hints`, under `if TYPE_CHECKING:` as well)."""
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for module, tree in _trees().items():
        deeper = deferred or type_hints
        for node in _all_imports(tree, type_hints) if deeper else _load_time_imports(tree.body):
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


@pytest.mark.parametrize(
    "deferred, type_hints",
    [(False, False), (True, False), (True, True)],
    ids=["load-time", "with-deferred", "with-type-hints"],
)
def test_the_package_has_no_import_cycles(deferred, type_hints):
    cycle = find_cycle(import_graph(deferred, type_hints))
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


# The layers, bottom up: each unit (a subpackage, or a module at the package's root) and the units
# it may import, type hints and deferred imports included. A new unit must be placed here; an arrow
# not in the table is one that runs up (or sideways where nothing needs it).
LAYERS: dict[str, set[str]] = {
    "version": set(),
    "config": set(),  # SpeculativeConfig: what the user asks for, plain data
    "core": {"config"},  # the decode engine: loop, verify, kv, draft protocol, policy, output
    "store": set(),  # cache folders on disk, their manifests, and what identifies a model's weights
    "hub": {"store"},  # fetching and checking checkpoints
    "heads": {"core", "hub", "store"},  # EAGLE / Medusa modules and their checkpoints
    "ort": {"core", "hub", "store"},  # ONNX Runtime export, sessions, int8 copies
    "drafters": {"config", "core", "heads", "hub", "ort", "store"},
    "selection": {"config", "core", "drafters", "hub", "ort", "store"},  # which draft for a target
    "integration": {"config", "core", "drafters", "selection"},  # generate(speculative=), pipelines
    "demo_model": {"store"},
    "memory": {"core", "drafters", "hub", "ort", "selection", "store"},
    "loading": {"core", "demo_model"},
    "lossless": {"core", "loading"},
    "bench": {"config", "core", "drafters", "heads", "loading", "lossless", "ort", "store"},
    "train": {"bench", "core", "heads", "loading", "store"},
    # vLLM, SGLang
    "serving": {"bench", "core", "drafters", "heads", "hub", "loading", "selection", "version"},
    "__init__": {"config", "core", "demo_model", "drafters", "integration", "memory", "selection", "version"},
    "cli": set(),  # python -m hf_specdec.cli: the command line is hf_specdec_cli, beside the package
}


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_unit_of_the_package_has_a_place_in_the_layers():
    units = {_unit(module) for module in MODULES}
    assert units == set(LAYERS), (
        f"place {sorted(units - set(LAYERS))} in LAYERS; gone: {sorted(set(LAYERS) - units)}"
    )


def test_imports_run_down_the_layers_only():
    """The first arrow that runs up fails, named by module."""
    for module, imported in sorted(import_graph(deferred=True, type_hints=True).items()):
        for target in sorted(imported):
            a, b = _unit(module), _unit(target)
            assert a == b or b in LAYERS[a], (
                f"{module} imports {target}: {a!r} may import only {sorted(LAYERS[a])}"
            )


def test_the_layer_table_has_no_cycle():
    assert find_cycle({unit: set(below) for unit, below in LAYERS.items()}) is None


def test_the_core_loads_nothing_above_it():
    """At run time as well: importing the decode loop loads no drafter, Hub or selection module.
    `hf_specdec/__init__.py` loads everything for its public API, so the package is stubbed."""
    code = (
        "import sys, types\n"
        f"package = types.ModuleType({ROOT!r}); package.__path__ = [{str(PACKAGE)!r}]\n"
        f"sys.modules[{ROOT!r}] = package\n"
        f"import {ROOT}.core.loop\n"
        f"print(sorted(m for m in sys.modules if m.startswith({ROOT + '.'!r})))\n"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert f"{ROOT}.core.loop" in loaded
    outside = [m for m in ast.literal_eval(loaded) if not m.startswith(f"{ROOT}.core")]
    assert outside == [], outside
