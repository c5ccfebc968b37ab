"""What `pyproject.toml` promises matches what the code needs."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]

# torch features the package uses -> the first torch release that has them.
TORCH_FEATURES = {
    "enable_gqa": (2, 5),  # F.scaled_dot_product_attention(..., enable_gqa=True)
}


def _torch_pin() -> tuple[int, ...]:
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pin = next(d for d in dependencies if re.match(r"torch\s*>=", d))
    return tuple(int(part) for part in re.search(r">=\s*([\d.]+)", pin).group(1).split("."))


@pytest.mark.parametrize("feature", list(TORCH_FEATURES))
def test_torch_pin_covers_the_features_used(feature):
    users = [p for p in (ROOT / "hf_specdec").rglob("*.py") if feature in p.read_text()]
    if not users:
        pytest.skip(f"{feature} is no longer used")
    needed = TORCH_FEATURES[feature]
    assert _torch_pin() >= needed, (
        f"{users[0].relative_to(ROOT)} uses {feature} (torch>={'.'.join(map(str, needed))}), "
        f"but pyproject.toml pins torch>={'.'.join(map(str, _torch_pin()))}"
    )


def test_a_wheel_carries_the_configs_the_package_reads(tmp_path):
    """An installed copy (a wheel, no checkout beside it) reads the draft registry and the built-in
    prompt suite from `hf_specdec/_configs`, which the build copies from `configs/`: without them
    `speculative=True` on a model the registry could know raised FileNotFoundError, and so did
    `hf-specdec bench`'s default suite."""
    source = tmp_path / "source"  # a copy: pip builds in the tree it is given, leaving build/ there
    source.mkdir()
    for file in ROOT.glob("*.*"):  # pyproject.toml, setup.py, MANIFEST.in, the README
        if file.is_file():
            shutil.copy(file, source / file.name)
    for folder in ("hf_specdec", "hf_specdec_cli", "configs"):
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    wheel = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "-q",
        "-w",
        str(tmp_path),
    ]
    build = subprocess.run([*wheel, str(source)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    installed = tmp_path / "installed"
    zipfile.ZipFile(next(tmp_path.glob("*.whl"))).extractall(installed)
    shipped = installed / "hf_specdec" / "_configs"
    assert _files(shipped) == _files(ROOT / "configs")
    read = subprocess.run(
        [
            sys.executable,
            "-c",
            "from hf_specdec.selection.select import registry_path\n"
            "from hf_specdec.bench.suites import builtin_suite_path\n"
            "print(registry_path(), builtin_suite_path(), sep='\\n')",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(installed)},
    )
    assert read.returncode == 0, read.stderr[-3000:]
    for path in read.stdout.split():
        assert Path(path).is_relative_to(installed) and Path(path).is_file(), path


def _files(folder: Path) -> set[Path]:
    return {p.relative_to(folder) for p in folder.rglob("*") if p.is_file()}
