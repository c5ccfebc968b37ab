"""Where hf-specdec keeps what it builds on disk."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where hf-specdec keeps what it builds: `$HF_SPECDEC_CACHE`, else `~/.cache/hf-specdec`."""
    root = os.environ.get("HF_SPECDEC_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hf-specdec"
