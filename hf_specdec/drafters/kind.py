"""What a draft given as `draft=` is, told by what it is rather than by the method named with it:
an official assistant, a model's MTP layers, a head or block draft (ours, or in its authors'
layout), or else a draft model. The one home of that rule: `method="auto"` runs a draft by it
(`selection.method`), and `draft_model` refuses the other kinds by it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from torch import nn
from transformers.modeling_layers import MtpModel

from ..heads.checkpoint import CheckpointFiles, checkpoint_method, folder_files, hub_files
from ..heads.dflash import BlockDraft
from ..heads.dflash_published import loaded_config, raw_has_dspark_heads
from ..heads.eagle import EagleHead
from ..heads.eagle3 import Eagle3Head
from ..heads.medusa import MedusaHead
from ..hub.download import HubFileError, hub_endpoint

# Assistants that draft from their target's shared KV (`drafters.assistant`), no draft models: their
# model types, and their classes' names.
ASSISTANT_TYPES = ("gemma4_assistant", "gemma4_unified_assistant")
_ASSISTANT_CLASSES = ("Gemma4Assistant", "Gemma4UnifiedAssistant")

# What a Hub repo was told to be, by (endpoint, repo id), so that a generate call with a draft named
# by repo does not ask the Hub again; only answers the Hub gave are kept. `clear_kinds` forgets them.
_HUB_METHODS: dict[tuple[str, str], str | None] = {}


def draft_method(draft: Any) -> str | None:
    """The method that drafts with `draft` (a loaded module, a folder, or a Hub repo id), by what it
    is: `"assistant"` (`is_assistant`), `"mtp"` for transformers' `MtpModel`, a head's or block
    draft's method (a loaded one; in a folder or repo, ours or the authors' EAGLE, Medusa, DFlash,
    DSpark layouts, as `heads.checkpoint.checkpoint_method` reads them); None for anything else: a
    draft model. A Hub repo is told from its listing, its JSON files and its safetensors header
    (nothing of a draft model's weights is downloaded); offline, from what the Hub cache holds.

    Raises:
        ValueError: the draft's files cannot be read, or a Hub repo holds pickled weights only, whose
            kind is not read (the message names the methods that would run it).
    """
    method = local_draft_method(draft)
    if method is not None or not isinstance(draft, str) or Path(draft).expanduser().exists():
        return method
    try:
        validate_repo_id(draft)
    except HFValidationError:
        return None
    key = (hub_endpoint(), draft)
    if key in _HUB_METHODS:
        return _HUB_METHODS[key]
    files = hub_files(draft)
    if files is None:
        return None
    try:
        method = _files_method(files)
    except HubFileError as err:  # a header the Hub failed to give for now: a draft model, this call only
        if err.lasting:
            raise
        return None
    if files.commit is not None:
        _HUB_METHODS[key] = method
    return method


def local_draft_method(draft: Any) -> str | None:
    """`draft_method` of a loaded module or a local folder; None for anything else (a Hub repo id is
    not asked about)."""
    if isinstance(draft, nn.Module):
        return _module_method(draft)
    if isinstance(draft, (str, os.PathLike)) and Path(draft).expanduser().is_dir():
        return _files_method(folder_files(Path(draft).expanduser()))
    return None


def is_assistant(draft: Any) -> bool:
    """Whether `draft` (a loaded model, or a folder with its config.json) is an assistant that drafts
    from its target's shared KV (`method="assistant"`) rather than a draft model of its own."""
    if isinstance(draft, nn.Module):
        return type(draft).__name__.startswith(_ASSISTANT_CLASSES)
    config = Path(str(draft)).expanduser() / "config.json" if draft is not None else None
    if config is None or not config.is_file():
        return False
    try:
        return json.loads(config.read_text()).get("model_type") in ASSISTANT_TYPES
    except (ValueError, AttributeError):
        return False


def clear_kinds() -> None:
    """Forget what Hub repos were told to be."""
    _HUB_METHODS.clear()


def _module_method(draft: nn.Module) -> str | None:
    if is_assistant(draft):
        return "assistant"
    if isinstance(draft, MtpModel):  # a model's own MTP layers
        return "mtp"
    if isinstance(draft, (EagleHead, Eagle3Head, MedusaHead)):
        return draft.config.method
    if isinstance(draft, BlockDraft):
        return "dspark" if draft.markov_head is not None or draft.confidence_head is not None else "dflash"
    raw = loaded_config(draft)  # a block draft loaded by transformers (MuseGlimmer's assistant)
    if raw is not None:
        return "dspark" if raw_has_dspark_heads(raw) else "dflash"
    return None


def _files_method(files: CheckpointFiles) -> str | None:
    return "assistant" if is_assistant(files.folder) else checkpoint_method(files)
