"""`method="auto"` made concrete before the loop starts: the draft given, run by what it is
(`drafters.kind`), else the one chosen (the model's own heads, then a published block draft for the
target, see `block`, then the rest); or, where no method can serve the call, plain decoding
(`plain_instead`)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import warnings
from typing import Any

from ..config import SpeculativeConfig
from ..core.checks import verify_refusal
from ..core.compat import generate_cache
from ..core.inputs import cached_columns, plain_feeds_otherwise
from ..core.kv import counts_columns, keeps_recurrent_state, rotary_refusal
from ..drafters.kind import draft_method
from ..ort.layout import is_onnx_folder
from .block import published_block_draft
from .choice import DRAFT_FREE_AUTO, DraftSelectionError, auto_method
from .select import registry_head, select_draft, speculative_draft

logger = logging.getLogger(__name__)


def resolve_method(config: SpeculativeConfig, model: Any) -> tuple[SpeculativeConfig, str]:
    """Turn `method="auto"` into a concrete drafter, a draft folder that only ONNX Runtime can load
    into `method="onnx"`, and an official assistant given to `"auto"` or `"draft_model"` (loaded,
    its folder or repo: transformers calls it an assistant model) into `method="assistant"`, without
    touching the user's config object; with why that drafter ("" for a method the user named)."""
    reason = ""
    if config.method == "auto" and config.draft is not None:  # run by what it is
        method = method_of_draft(config.draft)
        given = "the official assistant" if method == "assistant" else "the draft"
        return dataclasses.replace(config, method=method), f"{given} given as draft="
    if config.method == "draft_model" and given_method(config.draft) == "assistant":
        return dataclasses.replace(config, method="assistant"), "the official assistant given as draft="
    chosen = config.method == "auto"
    if chosen:
        config, reason = _choose_method(config, model)
    if config.method == "draft_model" and is_onnx_folder(config.draft):  # an export, no PyTorch weights
        config = dataclasses.replace(config, method="onnx")
    if chosen:
        target = getattr(model, "name_or_path", "") or type(model).__name__
        _log_once(f"method='auto' on {target} drafts with method={config.method!r}: {reason}")
    return config, reason


def draft_free_instead(config: SpeculativeConfig, chosen: str, model: Any) -> tuple[SpeculativeConfig, str]:
    """`"auto"`'s choice for a call continuing a filled cache where the drafter it chose (`chosen`: the
    model's own MTP layers, a published head or block draft) reads the target's hidden states, which
    that cache's earlier call did not keep: a draft-free method, with why. A draft the user gave is
    refused instead (`check_drafter_continues`)."""
    reason = (
        f"method={chosen!r} drafts from the target's hidden states of the whole context, which the "
        f"filled cache= does not hold: {DRAFT_FREE_AUTO} continues the conversation"
    )
    target = getattr(model, "name_or_path", "") or type(model).__name__
    _log_once(f"method='auto' on {target} drafts with method={DRAFT_FREE_AUTO!r}: {reason}")
    return dataclasses.replace(config, method=DRAFT_FREE_AUTO), reason


def plain_instead(
    config: SpeculativeConfig, model: Any, input_ids: Any, model_kwargs: dict[str, Any], max_length: int
) -> str | None:
    """Why `"auto"` decodes this call plainly, else None: it promises the output and no less than the
    speed of plain decoding, where a named method refuses what it cannot do (`RaggedKV`, `target_cache`,
    `check_rotary`, `check_supported`). At any batch size: a model it cannot verify drafts on at all
    (`verify_refusal`: an encoder-decoder, an encoder attending both ways, one that cannot roll back a
    draft), a model PEFT feeds otherwise for the call (`plain_feeds_otherwise`), or rotary frequencies
    that change within the call's length (`rotary_refusal`). In a batch: a recurrent state
    (linear-attention or state-space layers, as `cache` holds them) rolls back one row at a time, and
    positions or a window counted in cache columns (`counts_columns`) hold for one row at a time."""
    if config.method != "auto":
        return None
    # [batch, frames, codebooks] where each position holds several codebooks' tokens (CSM).
    (batch_size, prompt_width), cache = input_ids.shape[:2], generate_cache(model_kwargs)
    cached = cached_columns(model_kwargs)
    if (why := verify_refusal(model)) is not None:
        reason = f"{type(model).__name__}{why}"
    elif (otherwise := plain_feeds_otherwise(model)) is not None:
        reason = f"{type(model).__name__}: {otherwise}"
    elif (rotary := rotary_refusal(model, cached, prompt_width, max_length)) is not None:
        reason = f"{type(model).__name__} {rotary}"
    elif batch_size == 1:
        return None
    elif keeps_recurrent_state(model, cache):
        reason = (
            f"{type(model).__name__} keeps a recurrent state a row (linear-attention or state-space "
            f"layers), which speculative decoding rolls back for one row at a time, not for a batch of "
            f"{batch_size}"
        )
    elif (counted := counts_columns(model)) is not None:
        reason = f"{type(model).__name__} {counted}, which the holes of a batch of {batch_size} would move"
    else:
        return None
    return plainly_because(reason)


def plainly_because(reason: str) -> str:
    """`reason`, logged once: why `"auto"` decodes a call plainly."""
    _log_once(f"method='auto' decodes plainly: {reason}")
    return reason


def _choose_method(config: SpeculativeConfig, model: Any) -> tuple[SpeculativeConfig, str]:
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


@functools.lru_cache(maxsize=256)
def _log_once(message: str) -> None:
    """Log the choice `auto` made at INFO, once per choice: every call of a loop makes it again."""
    logger.info(message)


def method_of_draft(draft: Any) -> str:
    """The method `method="auto"` runs a draft given as `draft=` with: what it is (`given_method`),
    else `onnx` for a folder holding only an ONNX export, else `draft_model`. `export-serving` with
    no `--method` exports a `--draft` by it too."""
    method = given_method(draft) or "draft_model"
    return "onnx" if method == "draft_model" and is_onnx_folder(draft) else method


def given_method(draft: Any) -> str | None:
    """The method that runs a draft given as `draft=`: the registry's for a published head or block
    draft it lists (offline too), else what the draft is (`drafters.kind.draft_method`); None for a
    draft model."""
    entry = registry_head(draft) if isinstance(draft, str) else None
    return entry["method"] if entry is not None else draft_method(draft)
