"""`method="auto"` made concrete before the loop starts: the draft given, else the one chosen (the
model's own heads, then a published block draft for the target, see `block`, then the rest)."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from ..config import SpeculativeConfig
from ..drafters.draft_model import is_assistant
from ..drafters.head_drafter import head_method
from ..ort.layout import is_onnx_folder
from .block import block_method, published_block_draft
from .choice import DRAFT_FREE_AUTO, DraftSelectionError, auto_method
from .select import select_draft, speculative_draft


def resolve_method(config: SpeculativeConfig, model: Any) -> tuple[SpeculativeConfig, str]:
    """Turn `method="auto"` into a concrete drafter, a draft folder that only ONNX Runtime can load
    into `method="onnx"`, and an official assistant (a loaded one, or its folder) into
    `method="assistant"`, without touching the user's config object; with why that drafter ("" for
    a method the user named)."""
    reason = ""
    if config.method in ("auto", "draft_model") and is_assistant(config.draft):
        return dataclasses.replace(config, method="assistant"), "the official assistant given as draft="
    if config.method == "auto":
        config, reason = _choose_method(config, model)
    if config.method == "draft_model" and is_onnx_folder(config.draft):  # an export, no PyTorch weights
        return dataclasses.replace(config, method="onnx"), reason
    return config, reason


def _choose_method(config: SpeculativeConfig, model: Any) -> tuple[SpeculativeConfig, str]:
    if config.draft is not None:
        method = block_method(config.draft) or head_method(config.draft) or "draft_model"
        return dataclasses.replace(config, method=method), "the draft given as draft="
    try:
        choice = select_draft(model, trust_remote_code=config.trust_remote_code)
    except DraftSelectionError as err:  # the Hub's answer on the target (private, gated, gone)
        warnings.warn(f"{err} Speculating without a draft model ({DRAFT_FREE_AUTO}) instead.", stacklevel=4)
        return dataclasses.replace(config, method=DRAFT_FREE_AUTO), f"no draft could be chosen: {err}"
    block = published_block_draft(model, choice)
    if block is not None:
        method, draft, reason = block
        return dataclasses.replace(config, method=method, draft=draft), reason
    # A chosen draft that cannot be loaded safely comes back as "ngram", with a warning.
    choice, draft, draft_tokenizer = speculative_draft(
        model, choice, trust_remote_code=config.trust_remote_code
    )
    if draft is None:
        method = auto_method(choice.method)
        return dataclasses.replace(config, method=method), choice.reason
    if choice.translation is not None:  # a draft of another tokenizer, chosen for how it translates
        extra = {"translation": choice.translation}
    elif choice.method == "draft_model":
        # The selection compared the tokenizers already (or the registry pair was reviewed).
        extra = {"tokenizer_verified": True}
    else:
        extra = {}
    options = {**config.options, **extra}
    resolved = dataclasses.replace(
        config, method=choice.method, draft=draft, draft_tokenizer=draft_tokenizer, options=options
    )
    return resolved, choice.reason
