"""Draft sources, one per module, registered by name. `method="..."` is a look-up in `DRAFTERS`."""

from __future__ import annotations

from ..core.draft import Draft, DraftRequest
from . import draft_model, eagle, medusa, ngram, onnx, quantized  # noqa: F401  (importing registers them)
from .base import Drafter
from .registry import DRAFTERS, build_drafter, register_drafter

__all__ = ["DRAFTERS", "Draft", "DraftRequest", "Drafter", "build_drafter", "register_drafter"]
