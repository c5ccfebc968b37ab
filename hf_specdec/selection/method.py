"""`method="auto"` made concrete before the loop starts: the draft given, else the one chosen."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..config import SpeculativeConfig
from ..ort.layout import is_onnx_folder
from .choice import DRAFT_FREE_METHOD
from .select import speculative_draft

# Where no draft model is chosen: prompt lookup, plus the model's corpus of earlier calls wherever
# its replays show that it beats prompt lookup alone (`drafters/suffix.py`); until then its drafts
# are prompt lookup's.
DRAFT_FREE_AUTO = "suffix"


def resolve_method(config: SpeculativeConfig, model: Any) -> SpeculativeConfig:
    """Turn `method="auto"` into a concrete drafter, and a draft folder that only ONNX Runtime can
    load into `method="onnx"`, without touching the user's config object."""
    if config.method == "auto":
        config = _choose_method(config, model)
    if config.method == "draft_model" and is_onnx_folder(config.draft):  # an export, no PyTorch weights
        return dataclasses.replace(config, method="onnx")
    return config


def _choose_method(config: SpeculativeConfig, model: Any) -> SpeculativeConfig:
    if config.draft is not None:
        return dataclasses.replace(config, method="draft_model")
    # A chosen draft that cannot be loaded safely comes back as "ngram", with a warning.
    choice, draft, draft_tokenizer = speculative_draft(model, trust_remote_code=config.trust_remote_code)
    if draft is None:
        method = DRAFT_FREE_AUTO if choice.method == DRAFT_FREE_METHOD else choice.method
        return dataclasses.replace(config, method=method)
    # The selection compared the tokenizers already (or the registry pair was reviewed).
    options = {**config.options, "tokenizer_verified": True}
    return dataclasses.replace(
        config, method=choice.method, draft=draft, draft_tokenizer=draft_tokenizer, options=options
    )
