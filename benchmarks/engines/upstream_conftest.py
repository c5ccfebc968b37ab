"""conftest.py for transformers' own generation tests, run against hf-specdec
(`benchmarks/engines/upstream_tests.py`).

`benchmarks/engines/upstream_tests.py` copies this file as the conftest.py of the test tree it extracts from a
transformers checkout. `HF_SPECDEC_UPSTREAM` says what runs:

- `stock`: transformers' own assisted generation, untouched (the baseline);
- `ours`: every `generate(assistant_model=A)` becomes `generate(speculative=SpeculativeConfig(
  method="draft_model", draft=A, num_draft_tokens=A.generation_config.num_assistant_tokens))` and
  every `generate(prompt_lookup_num_tokens=n)` becomes `speculative=SpeculativeConfig(method="ngram",
  num_draft_tokens=n)`. Nothing else changes: the tests' own assertions judge the output.

`HF_SPECDEC_UPSTREAM_TREE=1` (with `ours`) drafts trees instead of chains: the same checks then
cover the accepted path's slices of a tree verification.
"""

from __future__ import annotations

import ast
import functools
import os
from pathlib import Path
from typing import Any

MODE = os.environ.get("HF_SPECDEC_UPSTREAM", "stock")
DEFINED: list[str] = []  # transformers names the tests import, taken from the checkout


def _translate() -> None:
    from transformers.generation.utils import GenerationMixin

    from hf_specdec import SpeculativeConfig  # importing adds speculative= to generate

    generate = GenerationMixin.generate
    tree = os.environ.get("HF_SPECDEC_UPSTREAM_TREE") == "1"

    @functools.wraps(generate)
    def generate_speculatively(
        self: Any,
        *args: Any,
        assistant_model: Any = None,
        prompt_lookup_num_tokens: int | None = None,
        **kwargs: Any,
    ) -> Any:
        if assistant_model is not None:
            draft_tokens = int(assistant_model.generation_config.num_assistant_tokens)
            speculative = SpeculativeConfig(
                method="draft_model", draft=assistant_model, num_draft_tokens=draft_tokens, tree=tree
            )
        elif prompt_lookup_num_tokens is not None:
            speculative = SpeculativeConfig(
                method="ngram", num_draft_tokens=prompt_lookup_num_tokens, tree=tree
            )
        else:
            return generate(self, *args, **kwargs)
        return generate(self, *args, speculative=speculative, **kwargs)

    GenerationMixin.generate = generate_speculatively


def _define_missing_names() -> list[str]:
    """Names the tests import from transformers that the installed version lacks (a checkout newer or
    older than the install), defined from the checkout's own source of that module: the plumbing of
    mixins and testers (defaults, helpers of tests not run here), never an assertion."""
    import importlib

    root = Path(__file__).resolve().parent
    wanted: dict[str, set[str]] = {}
    for node in _imports_of(root, sorted((root / "tests" / "models").glob("*/test_modeling_*.py"))):
        if (node.module or "").startswith("transformers"):
            wanted.setdefault(node.module, set()).update(alias.name for alias in node.names)
    defined = []
    for module_name, names in sorted(wanted.items()):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue  # a module this install lacks: only tests of other features import it
        missing = {name for name in names if name != "*" and not _has(module, name)}
        missing -= {n for n in missing if _is_submodule(module_name, n)}
        if not missing:
            continue
        source = _checkout_source(root, module_name)
        for node in ast.parse(source).body:
            names_here = {t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)}
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AnnAssign)):
                names_here.add(node.name if hasattr(node, "name") else getattr(node.target, "id", ""))
            if names_here & missing:
                exec(compile(ast.Module([node], []), f"checkout:{module_name}", "exec"), module.__dict__)
        still = sorted(name for name in missing if not hasattr(module, name))
        if still:
            raise ImportError(
                f"The tests import {still} from {module_name}, which neither the installed transformers "
                "nor the checkout defines there: take the tests from the installed version's tag."
            )
        defined += [f"{module_name}.{name}" for name in sorted(missing)]
    return defined


def _imports_of(root: Path, files: list[Path]) -> list[ast.ImportFrom]:
    """Every `from ... import` of these test files and of the tree's modules they import, transitively."""
    seen, todo, found = set(), list(files), []
    while todo:
        path = todo.pop()
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level == 0:
                found.append(node)
                continue
            base = path.parent
            for _ in range(node.level - 1):
                base = base.parent
            target = base.joinpath(*(node.module or "").split("."))
            todo += [target.with_suffix(".py"), target / "__init__.py"]
            todo += [target / f"{alias.name}.py" for alias in node.names]
    return found


def _has(module: Any, name: str) -> bool:
    try:
        return hasattr(module, name)
    except Exception:  # a lazy attribute whose import fails
        return False


def _is_submodule(module_name: str, name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(f"{module_name}.{name}") is not None
    except ImportError:
        return False


def _checkout_source(root: Path, module_name: str) -> str:
    path = root / "checkout" / "src" / Path(*module_name.split("."))
    return (path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).read_text()


def pytest_configure(config: Any) -> None:
    global DEFINED
    DEFINED = _define_missing_names()
    if MODE == "ours":
        _translate()
    elif MODE != "stock":
        raise ValueError(f"HF_SPECDEC_UPSTREAM={MODE!r}: use 'stock' or 'ours'.")


def pytest_report_header(config: Any) -> str:
    import transformers

    header = f"hf-specdec upstream run: {MODE}, transformers {transformers.__version__}"
    if DEFINED:
        header += f", names from the checkout: {', '.join(DEFINED)}"
    if MODE == "ours":
        import hf_specdec

        header += f", hf_specdec from {os.path.dirname(hf_specdec.__file__)}"
    return header
