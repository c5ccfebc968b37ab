"""Helpers every drafter module uses; the `Drafter` protocol itself lives with the data it reads and
answers, in `core/draft.py`, since the loop calls it."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..core.draft import Drafter
from ..core.timing import clock


def elapsed(start: float, result: torch.Tensor) -> float:
    """Seconds since `start` (a `timing.clock` read) once `result`'s device has finished computing it."""
    return clock(result.device) - start


def options_to_config(config_cls: type, options: dict[str, Any]) -> Any:
    """Build a drafter's config dataclass from `SpeculativeConfig.options`, naming unknown keys."""
    known = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"Unknown option(s) {unknown} for {config_cls.__name__}; valid: {sorted(known)}.")
    return config_cls(**options)


__all__ = ["Drafter", "elapsed", "options_to_config"]
