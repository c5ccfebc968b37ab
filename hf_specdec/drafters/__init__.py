"""Draft sources, one per module, registered by name. `method="..."` is a look-up in `DRAFTERS`."""

from __future__ import annotations

import importlib
import pkgutil

from ..core.draft import Draft, DraftRequest
from .base import Drafter
from .registry import DRAFTERS, build_drafter, register_drafter

# Every module of this package is imported, and a drafter registers itself when its module runs:
# adding a draft source is adding its module, with no list to extend.
for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["DRAFTERS", "Draft", "DraftRequest", "Drafter", "build_drafter", "register_drafter"]
