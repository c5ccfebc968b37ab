"""What `pyproject.toml` promises matches what the code needs."""

from __future__ import annotations

import re
import sys
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
