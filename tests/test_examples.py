"""The examples as a reader runs them, `python examples/<name>.py` in a fresh interpreter; and the
custom-drafter example as the proof that a new draft source is one file."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import child_env

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
PACKAGE = ROOT / "hf_specdec"


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=child_env(),
        timeout=900,
    )


@pytest.mark.slow
def test_the_custom_drafter_example_drafts_and_stays_lossless(smollm2_path):
    result = _run("custom_drafter.py", str(smollm2_path))
    assert result.returncode == 0, result.stderr[-3000:]  # it exits 1 if the output is not greedy's
    accepted = re.search(r"^repeat: .* (\d+)/(\d+) drafted tokens accepted", result.stdout, re.MULTILINE)
    assert accepted, result.stdout
    assert int(accepted.group(1)) > 0  # its drafts were proposed, verified and kept
    assert "vs plain greedy generate: " in result.stdout


def _imports_of_ours(tree: ast.Module) -> list[tuple[str, str | None]]:
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "hf_specdec":
            found += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names if alias.name.split(".")[0] == "hf_specdec"]
    return found


def test_a_new_drafter_is_one_file():
    """The example's drafter needs nothing but the public API (the package's top level and its
    packages, the names they export), and no list in the package names it."""
    source = (EXAMPLES / "custom_drafter.py").read_text()
    imports = _imports_of_ours(ast.parse(source))
    assert ("hf_specdec.drafters", "register_drafter") in imports
    for module, name in imports:
        assert module.count(".") <= 1 and not any(part.startswith("_") for part in module.split("."))
        if name is not None:
            exported = getattr(importlib.import_module(module), "__all__", None)
            assert not name.startswith("_") and (exported is None or name in exported), (module, name)
    drafter_name = re.search(r'name: ClassVar\[str\] = "(\w+)"', source).group(1)
    naming = [p for p in PACKAGE.rglob("*.py") if re.search(rf"[\"']{drafter_name}[\"']", p.read_text())]
    assert naming == [], f"{drafter_name!r} is named in {naming}"
