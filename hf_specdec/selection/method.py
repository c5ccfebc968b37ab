"""`method="auto"` made concrete before the loop starts: the draft given, else the one chosen."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..config import SpeculativeConfig
from ..ort.layout import is_onnx_folder
from .select import speculative_draft


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
        return dataclasses.replace(config, method=choice.method)
    if choice.translation is None:
        # The selection compared the tokenizers already (or the registry pair was reviewed).
        options = {**config.options, "tokenizer_verified": True}
    else:  # a draft of another tokenizer, chosen for how it translates to the target's
        options = {**config.options, "translation": choice.translation}
    return dataclasses.replace(
        config, method=choice.method, draft=draft, draft_tokenizer=draft_tokenizer, options=options
    )
