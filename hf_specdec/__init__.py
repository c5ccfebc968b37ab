"""hf-specdec: lossless speculative decoding for Hugging Face transformers.

import hf_specdec  # adds `speculative=` to model.generate() and text-generation pipelines
out = model.generate(**inputs, max_new_tokens=200, speculative=True)
"""

from __future__ import annotations

from .config import SpeculativeConfig
from .core.output import SpeculativeGenerateOutput
from .core.policy import AdaptiveDraftLength, DraftLengthPolicy, FixedDraftLength
from .core.stats import SpeculativeStats
from .demo_model import demo_model_path
from .drafters import DRAFTERS, register_drafter
from .integration import install, uninstall
from .memory import clear_cache
from .selection.select import DraftChoice, select_draft
from .version import __version__

install()

__all__ = [
    "DRAFTERS",
    "AdaptiveDraftLength",
    "DraftLengthPolicy",
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
    "__version__",
    "uninstall",
]
