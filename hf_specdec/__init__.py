"""hf-specdec: lossless speculative decoding for Hugging Face transformers.

import hf_specdec  # adds `speculative=` to model.generate() and text-generation pipelines
out = model.generate(**inputs, max_new_tokens=200, speculative=True)
"""

from __future__ import annotations

from .config import SpeculativeConfig
from .drafters import DRAFTERS, register_drafter
from .integration import install, uninstall
from .memory import clear_cache
from .models import demo_model_path
from .output import SpeculativeGenerateOutput
from .policy import AdaptiveDraftLength, FixedDraftLength
from .selection import DraftChoice, select_draft
from .stats import SpeculativeStats

__version__ = "0.1.0"

install()

__all__ = [
    "DRAFTERS",
    "AdaptiveDraftLength",
    "DraftChoice",
    "FixedDraftLength",
    "SpeculativeConfig",
    "SpeculativeGenerateOutput",
    "SpeculativeStats",
    "clear_cache",
    "demo_model_path",
    "install",
    "register_drafter",
    "select_draft",
    "uninstall",
]
