"""Where hf-specdec keeps what it builds on disk."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    """Where hf-specdec keeps what it builds: `$HF_SPECDEC_CACHE`, else `~/.cache/hf-specdec`."""
    root = os.environ.get("HF_SPECDEC_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hf-specdec"


def cannot_write_in(folder: Path) -> str | None:
    """Why a file cannot be written in `folder` (one that exists), or None: tried, since
    permissions alone do not tell (root, read-only mounts, /proc)."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            return None
    except OSError as err:
        return err.strerror or str(err)
