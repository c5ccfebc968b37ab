"""Helpers every drafter module uses; the `Drafter` protocol itself lives with the data it reads and
answers, in `core/draft.py`, since the loop calls it."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..core.draft import Drafter, DraftRequest
from ..core.kv import positions
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


class RowState:
    """What a drafter keeps per row of the loop's batch across requests (a cache of its own, counts
    per row), mixed into the drafters that keep any: built at the first request for its rows
    (`_start_rows`); when rows finish and leave the batch, kept for the rows that remain, in the
    request's order (`_keep_rows`). Set `row_ids = []` in `__init__`; a drafter that builds its state
    beforehand (`compile_forwards`) sets it to the rows it built it for."""

    row_ids: list[int]  # the loop's rows (`DraftRequest.row_ids`) the state is for, in its order

    def _follow_rows(self, request: DraftRequest) -> None:
        if not self.row_ids:
            self._start_rows(request)
        elif request.row_ids != self.row_ids:
            self._keep_rows(positions(self.row_ids, request.row_ids))
        self.row_ids = list(request.row_ids)

    def _start_rows(self, request: DraftRequest) -> None:
        """Build the state for the rows of the first request."""
        raise NotImplementedError

    def _keep_rows(self, kept: list[int]) -> None:
        """Keep the state of rows `kept` only (indices into the rows held so far), in that order."""
        raise NotImplementedError


__all__ = ["Drafter", "RowState", "elapsed", "options_to_config"]
